"""``ridgeline export RECORDING -o DIR``: a ``.rlrec`` recording as a Parquet recording.

The folder's layout and schema are agent.parquet_recording's (docs/parquet-schema.md);
several recordings, of one host or of many, may be exported into the same folder (each
keeps its own recording id). Needs the ``ridgeline[parquet]`` extra (pyarrow).
"""
from __future__ import annotations

import sys

from ridgeline.agent.commands import description
from ridgeline.probes.errors import InputError


def register(sub) -> None:
    p = sub.add_parser("export", help="convert a recording (.rlrec) to Parquet (Hive-style folders)",
                       description=description(__doc__) + " " + description(__doc__, 1))
    p.add_argument("recording", metavar="RECORDING", help="a recording written by `ridgeline record`")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="folder of the Parquet recording")
    p.add_argument("--recording-id", metavar="ID",
                   help="id the rows carry (default: the recording's file name without .rlrec)")
    p.set_defaults(func=run)


def run(args) -> int:
    import re
    from pathlib import Path

    from ridgeline.agent.parquet_recording import ParquetRecordingWriter
    from ridgeline.agent.recording import is_recording, iter_frames
    src = Path(args.recording)
    if not src.is_file():
        raise InputError(f"{src}: no such recording file")
    if not is_recording(src):
        raise InputError(f"{src}: not a ridgeline recording (bad magic)")
    rid = args.recording_id or re.sub(r"[^A-Za-z0-9._-]", "_", src.name.removesuffix(".rlrec"))[:100] or "recording"
    report: dict = {}
    with ParquetRecordingWriter(args.output, recording=rid) as w:
        for i, (recv_ns, env) in enumerate(iter_frames(src, report)):
            try:
                w.write(env, recv_ns)
            except InputError as exc:
                raise InputError(f"{src}: frame {i}: {exc}") from None
            except (ValueError, KeyError, TypeError) as exc:   # msgpack's and the codec's refusals
                raise InputError(f"{src}: frame {i} does not decode ({type(exc).__name__})") from None
    print(f"ridgeline export: {w.frames} messages, {w.rows} rows, {w.files} files, {w.bytes} bytes "
          f"to {args.output} (recording {rid})" + ("; last frame truncated" if report.get("truncated") else ""),
          file=sys.stderr)
    return 0
