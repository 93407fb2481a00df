"""``ridgeline analyze TRACE...``: per-phase roofline and verdict of recorded traces.

A TRACE is a Kineto / PyTorch-profiler Chrome trace (``.json``, ``.json.gz``; the
current schema, the pre-1.10 one, or Chrome's JSON Array Format), a recording of the
agent's stream (``ridgeline record``), or an Nsight Systems SQLite export (``nsys export
--type sqlite``), told apart by the file's content; or a DIRECTORY of such files (one per
rank, as vLLM writes them), reported per rank and together.

Every input is bounded: only regular files are read (a FIFO or device is refused), the
events kept must fit the ``--max-memory`` budget (default 1 GiB; probes.budget), and a
recording is analysed segment by segment (agent.recording_analysis) whatever its length.

One report per trace, in the order given. ``--json`` prints one JSON object for one
trace and a JSON array of objects for several (keys in docs/analyze.md). ``--plot`` and
``--perfetto`` take a file name; with several traces the trace's position is inserted
before the suffix (``roofline.png`` -> ``roofline.1.png``, ``roofline.2.png``).
"""
from __future__ import annotations

import sys
from pathlib import Path

import orjson
from msgspec import UNSET

from ridgeline.probes.errors import InputError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "analyze", help="per-phase roofline, verdict and evidence of recorded traces",
        description="Analyse recorded GPU traces (Kineto/PyTorch-profiler JSON or .json.gz, any schema; "
                    "Chrome JSON arrays; ridgeline recordings; Nsight Systems SQLite exports; a directory "
                    "of per-rank traces): phases, achieved FLOP/s and bytes/s against the GPU's ceilings, "
                    "verdicts, idle gaps, launch latency and copy traffic. Memory is bounded by --max-memory.")
    p.add_argument("traces", nargs="+", metavar="TRACE",
                   help="trace file(s): Kineto JSON (.json, .json.gz), a ridgeline recording, an Nsight "
                        "Systems SQLite export, or a directory of per-rank traces")
    p.add_argument("--gpu", metavar="NAME", help="GPU model for the ceilings (e.g. h100-sxm, 'NVIDIA H200'); "
                                                 "default: from the trace's device properties")
    p.add_argument("--model", metavar="CONFIG", help="Hugging Face config.json (or folder, or a built-in: "
                                                     "llama-3-8b, qwen1.5-0.5b, qwen3-0.6b, mixtral-8x7b, gpt-oss-120b)")
    p.add_argument("--context-len", type=int, metavar="TOKENS",
                   help="tokens per sequence (prompt length for prefill, context for decode) for the "
                        "model's attention and KV-read terms")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="GPUs the model is split over by tensor parallelism (the model's work per GPU is 1/N)")
    p.add_argument("--ceilings", metavar="FILE", help="user TOML of GPU ceilings, overlaid on the built-in table")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--plot", metavar="FILE.png", help="write a roofline plot (PNG)")
    p.add_argument("--perfetto", metavar="FILE.json", help="write a Perfetto-loadable trace with a phase track")
    p.add_argument("--max-memory", type=int, default=1024, metavar="MIB",
                   help="memory an analysis may use (default 1024 MiB): a trace holding more events is "
                        "refused; a recording is analysed in segments that fit")
    p.add_argument("--no-annotations", action="store_true",
                   help="map phases from kernel events alone, ignoring step annotations")
    p.set_defaults(func=run)


class ParquetRef(tuple):
    """One recording (host, recording id) in a Parquet recording folder."""
    __slots__ = ()

    def __new__(cls, root: str, host: str, recording: str):
        return super().__new__(cls, (root, host, recording))

    root = property(lambda self: self[0])
    host = property(lambda self: self[1])
    recording = property(lambda self: self[2])

    def __str__(self) -> str:
        return f"{self.root} (host={self.host}, recording={self.recording})"


def _numbered(path: str, i: int, n: int) -> str:
    if n == 1:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{i + 1}{p.suffix}"))


_SQLITE_MAGIC = b"SQLite format 3\x00"
_TRACE_SUFFIXES = (".json", ".json.gz", ".rlrec", ".sqlite", ".sqlite3")


def _regular_file(path: str) -> Path:
    """The path, if it names a regular file; InputError otherwise (never open a FIFO:
    reading one blocks until a writer comes, a device never ends)."""
    import stat
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise InputError(f"{path}: is a directory, not a trace file")
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a character device" if stat.S_ISCHR(st.st_mode)
                else "a block device" if stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "not a regular file")
        raise InputError(f"{path}: is {kind}, not a trace file")
    return p


def _magic(p: Path, n: int = 16) -> bytes:
    try:
        with open(p, "rb") as f:
            return f.read(n)
    except OSError as exc:
        raise InputError(f"{p}: cannot read ({exc.strerror})") from None


def _named(path: str, exc: InputError) -> InputError:
    """The error with the file named (readers deep inside may not know it)."""
    msg = str(exc)
    return exc if path in msg else InputError(f"{path}: {msg}", exc.exit_code)


def _load(path: str, budget=None):
    """The Trace of a Kineto file or an Nsight Systems export (recordings: _is_recording)."""
    p = _regular_file(path)
    from ridgeline.probes.file_kind import mismatch
    bad = mismatch(path, _magic(p))
    if bad:          # named by its content, not by the first parser that fails on it
        raise InputError(bad)
    try:
        if _magic(p).startswith(_SQLITE_MAGIC):
            from ridgeline.probes.nsys import load_trace as load_nsys
            return load_nsys(p, budget=budget)
        from ridgeline.probes.kineto import load_trace
        return load_trace(p, budget=budget)
    except InputError as exc:
        raise _named(path, exc) from None


def _is_recording(path: str) -> bool:
    from ridgeline.agent.recording import is_recording
    return is_recording(_regular_file(path))


def _rank_files(path: str) -> list[str]:
    """Trace files of a per-rank directory, in name order (natural: rank 2 before 10)."""
    import re
    d = Path(path)
    files = [f for f in d.iterdir() if f.name.endswith(_TRACE_SUFFIXES) and not f.name.startswith(".")]
    if not files:
        raise InputError(f"{path}: a directory without trace files ({', '.join(_TRACE_SUFFIXES)})")
    key = lambda f: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", f.name)]  # noqa: E731
    return [str(f) for f in sorted(files, key=key)]


def carried_model(meta: dict, path: str, said: set):
    """The model a recording's or a simulated trace's metadata names (``meta["model"]``),
    when it is one of the built-in configurations; said once per file on stderr. A path
    named inside a file is never opened (the file is input, not configuration)."""
    from ridgeline.aggregator import model_config
    name = meta.get("model")
    if not isinstance(name, str) or name.lower() not in model_config.BUILTIN:
        return None
    if path not in said:
        said.add(path)
        print(f"ridgeline: {path}: model {name} from the trace's metadata (--model overrides)", file=sys.stderr)
    return model_config.builtin(name)


def _warn_rejected(path: str, trace) -> None:
    rej = trace.meta.get("rejected_events")
    if rej:
        n = sum(sum(v.values()) for v in rej.values())
        detail = "; ".join(f"{k}: " + ", ".join(f"{r} {c}" for r, c in v.items()) for k, v in rej.items())
        print(f"ridgeline: warning: {path}: {n} events dropped ({detail})", file=sys.stderr)


def run(args) -> int:
    from ridgeline.aggregator import model_config
    from ridgeline.aggregator.analysis import analyze_trace
    from ridgeline.aggregator.phases import map_phases
    from ridgeline.probes.budget import EventBudget
    from ridgeline.probes.records import PHASE_NAMES as phase_names

    if args.context_len is not None and args.context_len <= 0:
        raise InputError("--context-len must be a positive number of tokens")
    if args.context_len is not None and not args.model:
        raise InputError("--context-len needs --model")
    if args.tensor_parallel < 1:
        raise InputError("--tensor-parallel must be at least 1")
    if args.max_memory < 256:
        raise InputError("--max-memory must be at least 256 MiB")
    max_memory_bytes = args.max_memory << 20
    model = model_config.load(args.model) if args.model else None
    if args.plot and not args.plot.lower().endswith(".png"):
        raise InputError(f"--plot {args.plot}: the plot is written as PNG; name the file *.png")
    use_ann = not args.no_annotations

    said: set = set()

    def analyze_one(trace, path, keep=None):
        trace.meta.setdefault("path", path)
        pm = map_phases(trace, use_annotations=use_ann)
        m = model if model is not None else carried_model(trace.meta, path, said)
        doc = analyze_trace(trace, gpu=args.gpu, model=m, context_len=args.context_len,
                            tensor_parallel=args.tensor_parallel, use_annotations=use_ann,
                            ceilings_path=args.ceilings, phase_map=pm)
        if trace.meta.get("rejected_events"):
            doc.rejected_events = trace.meta["rejected_events"]
        if "rank" in trace.meta:
            doc.rank = trace.meta["rank"]
        if "world_size" in trace.meta:
            doc.world_size = trace.meta["world_size"]
        if keep is not None:
            keep[:] = [trace, pm]
        return doc

    def analyze_path(path):
        """(doc, trace, phase map) of one file; trace and map None for a recording
        unless --perfetto asks for its last segment."""
        if isinstance(path, ParquetRef):
            from ridgeline.agent import parquet_recording as pqr
            from ridgeline.agent.recording_analysis import analyze_recording
            last: list = []
            label = str(path)
            doc = analyze_recording(
                label, lambda t: analyze_one(t, label, last if args.perfetto else None), max_memory_bytes,
                segments=lambda mm, sm: pqr.iter_segments(path.root, path.host, path.recording, mm, sm),
                fmt=pqr.FORMAT)
            return doc, *(last or [None, None])
        if _is_recording(path):
            from ridgeline.agent.recording_analysis import analyze_recording
            last: list = []
            try:
                doc = analyze_recording(path, lambda t: analyze_one(t, path, last if args.perfetto else None),
                                        max_memory_bytes)
            except InputError as exc:
                raise _named(path, exc) from None
            if doc.recording is not UNSET and doc.recording.truncated:
                print(f"ridgeline: warning: {path}: truncated recording (it ends inside a frame); "
                      "analysed its complete frames", file=sys.stderr)
            return doc, *(last or [None, None])
        trace = _load(path, EventBudget(max_memory_bytes, path))
        _warn_rejected(path, trace)
        keep: list = []
        doc = analyze_one(trace, path, keep)
        return doc, keep[0], keep[1]

    # one entry per argument: a file, or a directory of per-rank files
    jobs = []
    for path in args.traces:
        from ridgeline.agent.parquet_recording import is_parquet_recording, recordings_in
        if is_parquet_recording(path):
            # a Parquet recording folder (ridgeline record --format parquet / export): one
            # report per host and recording in it, each as its .rlrec would give
            found = recordings_in(path)
            if not found:
                raise InputError(f"{path}: a Parquet recording folder without messages")
            jobs.extend((ParquetRef(path, h, r), None) for h, r in found)
        elif Path(path).is_dir():
            jobs.append((path, _rank_files(path)))
        else:
            jobs.append((path, None))
    docs = []
    n = sum(len(files) if files else 1 for _, files in jobs)
    i = 0
    for path, files in jobs:
        group = []
        for f in files or [path]:
            try:
                doc, trace, pm = analyze_path(f)
            except InputError as exc:
                # a folder of rank traces may hold other JSON (configs, results): said, skipped
                if files is None or not ("not a Kineto/Chrome trace" in str(exc) or "its content is" in str(exc)):
                    raise
                print(f"ridgeline: warning: skipped {f}: not a trace", file=sys.stderr)
                i += 1
                continue
            doc.trace = str(f)
            _outputs(args, doc, trace, pm, phase_names, i, n, str(f))
            group.append(doc)
            i += 1
        if files is None:
            docs.append(group[0])
        elif not group:
            raise InputError(f"{path}: none of its {len(files)} trace-named files is a trace")
        else:
            from ridgeline.agent.rank_report import together
            both = together(path, group)
            for why in both.together.not_one_job:
                print(f"ridgeline: warning: {path}: the traces are not one job ({why}); "
                      "no slowest rank named", file=sys.stderr)
            if not args.json:
                from ridgeline.agent.extras import require
                require("rich", "the text report (--json needs nothing more)")
                from ridgeline.agent.rank_report import render_together
                render_together(both)
            docs.append(both)
    if args.json:
        payload = docs[0] if len(docs) == 1 else docs
        from ridgeline.aggregator.analysis import document
        sys.stdout.buffer.write(orjson.dumps(document(payload), option=orjson.OPT_INDENT_2))
        sys.stdout.buffer.write(b"\n")
        sys.stdout.flush()
    return 0


def _requests_text(req) -> str:
    """The recording's served requests (the agent's request join): the slowest ones."""
    from ridgeline.agent import request_view
    stories, bad = request_view.stories_of({"stories": req.slowest})
    head = f"requests told by the agent: {req.told}; the {min(len(stories), 10)} slowest:"
    return head + "\n" + request_view.table(request_view.slowest(stories, 10)) + \
        (f"\n({bad} malformed request record(s) skipped)" if bad else "")


def _outputs(args, doc, trace, pm, phase_names, i, n, path) -> None:
    """The report (first: a failing output file must not lose it), then plot/Perfetto."""
    if not args.json:
        from ridgeline.agent.extras import require
        require("rich", "the text report (--json needs nothing more)")
        from ridgeline.aggregator.report import render
        render(doc)
        if doc.recording is not UNSET:
            print(_recording_line(doc.recording))
        if doc.requests is not UNSET:
            print(_requests_text(doc.requests))
    if args.perfetto:
        if trace is None:
            raise InputError(f"{path}: no events to write to --perfetto")
        from ridgeline.aggregator.perfetto import write_perfetto
        stories = None
        if doc.requests is not UNSET:       # a recording's served requests: a track each
            from ridgeline.agent import request_view
            stories, _bad = request_view.stories_of({"stories": doc.requests.slowest})
        out = write_perfetto(trace, pm, phase_names, _numbered(args.perfetto, i, n), requests=stories)
        doc.perfetto = str(out)
    if args.plot:
        from ridgeline.agent.extras import require
        require("matplotlib", "--plot")
        from ridgeline.aggregator.plot import plot_roofline
        out = plot_roofline(doc, _numbered(args.plot, i, n), title=f"{Path(path).name}")
        doc.plot = str(out)
    if not args.json:
        if doc.plot is not UNSET:
            print(f"plot: {doc.plot}")
        if doc.perfetto is not UNSET:
            print(f"perfetto: {doc.perfetto}")
        if i + 1 < n:
            print()


def _recording_line(rec) -> str:
    """What the agent's own record says of the recording (an
    :class:`aggregator.analysis.RecordingFacts`): restarts, lost messages and the downtime
    kept out of every idle figure."""
    gaps = sum(rec.gaps.values())
    by_topic = ", ".join(f"{k} {v}" for k, v in rec.gaps.items())
    parts = [f"recording: {rec.segments} segment(s)",
             f"{rec.restarts} agent restart(s)",
             f"{gaps} message(s) lost" + (f" ({by_topic})" if gaps else "")]
    if rec.downtime_ns:
        parts.append(f"{rec.downtime_ns / 1e9:.3f} s of agent downtime left out of GPU idle time")
    if rec.truncated:
        parts.append("last frame truncated")
    return "; ".join(parts)
