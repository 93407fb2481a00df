"""``ridgeline analyze TRACE...``: per-phase roofline and verdict of recorded traces.

A TRACE is a Kineto / PyTorch-profiler Chrome trace (``.json``, ``.json.gz``) or a
recording of the agent's stream (``ridgeline record``), told apart by the file's magic.

One report per trace, in the order given. ``--json`` prints one JSON object for one
trace and a JSON array of objects for several (keys in docs/analyze.md). ``--plot`` and
``--perfetto`` take a file name; with several traces the trace's position is inserted
before the suffix (``roofline.png`` -> ``roofline.1.png``, ``roofline.2.png``).
"""
from __future__ import annotations

import sys
from pathlib import Path

import orjson

from ridgeline.probes.errors import InputError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "analyze", help="per-phase roofline, verdict and evidence of Kineto traces",
        description="Analyse recorded GPU traces (Kineto/PyTorch-profiler JSON, .json.gz): phases, "
                    "achieved FLOP/s and bytes/s against the GPU's ceilings, verdicts, idle gaps, "
                    "launch latency and copy traffic.")
    p.add_argument("traces", nargs="+", metavar="TRACE", help="trace file(s)")
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
    p.add_argument("--no-annotations", action="store_true",
                   help="map phases from kernel events alone, ignoring step annotations")
    p.set_defaults(func=run)


def _numbered(path: str, i: int, n: int) -> str:
    if n == 1:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{i + 1}{p.suffix}"))


def _load(path: str):
    p = Path(path)
    if not p.exists():
        raise InputError(f"{path}: no such file")
    if p.is_dir():
        raise InputError(f"{path}: is a directory, not a trace file")
    try:
        from ridgeline.agent.recording import is_recording
    except ImportError:          # recordings not supported in this build
        is_recording = None
    if is_recording is not None and is_recording(p):
        # A recording of the agent's stream (`ridgeline record`): its merged event batches.
        from ridgeline.agent.recording import load_trace as load_recording_trace
        try:
            return load_recording_trace(p)
        except ImportError as exc:    # the wire codec is missing from this build
            raise InputError(f"{path}: a Ridgeline recording, but its decoder is unavailable ({exc})") from None
    from ridgeline.probes.kineto import load_trace
    return load_trace(p)


def run(args) -> int:
    from ridgeline.aggregator import model_config
    from ridgeline.aggregator.analysis import _phases_api, analyze_trace

    if args.context_len is not None and args.context_len <= 0:
        raise InputError("--context-len must be a positive number of tokens")
    if args.context_len is not None and not args.model:
        raise InputError("--context-len needs --model")
    if args.tensor_parallel < 1:
        raise InputError("--tensor-parallel must be at least 1")
    model = model_config.load(args.model) if args.model else None
    if args.plot and not args.plot.lower().endswith(".png"):
        raise InputError(f"--plot {args.plot}: the plot is written as PNG; name the file *.png")
    docs = []
    n = len(args.traces)
    phase_names, map_phases = _phases_api()
    for i, path in enumerate(args.traces):
        trace = _load(path)
        trace.meta.setdefault("path", path)
        pm = map_phases(trace, use_annotations=not args.no_annotations)
        doc = analyze_trace(trace, gpu=args.gpu, model=model, context_len=args.context_len,
                            tensor_parallel=args.tensor_parallel,
                            use_annotations=not args.no_annotations, ceilings_path=args.ceilings,
                            phase_map=pm)
        doc["trace"] = path
        if not args.json:
            # The report first: a failing output file must not lose it.
            from ridgeline.aggregator.report import render
            render(doc)
        if args.perfetto:
            from ridgeline.aggregator.perfetto import write_perfetto
            out = write_perfetto(trace, pm, phase_names, _numbered(args.perfetto, i, n))
            doc["perfetto"] = str(out)
        if args.plot:
            from ridgeline.aggregator.plot import plot_roofline
            out = plot_roofline(doc, _numbered(args.plot, i, n), title=f"{Path(path).name}")
            doc["plot"] = str(out)
        docs.append(doc)
        if not args.json:
            for key in ("plot", "perfetto"):
                if key in doc:
                    print(f"{key}: {doc[key]}")
            if i + 1 < n:
                print()
    if args.json:
        payload = docs[0] if n == 1 else docs
        sys.stdout.buffer.write(orjson.dumps(payload, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
        sys.stdout.buffer.write(b"\n")
        sys.stdout.flush()
    return 0
