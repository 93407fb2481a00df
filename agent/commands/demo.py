"""``ridgeline demo`` (``make demo``): the whole pipeline on one machine, no GPU needed.

What runs, all on loopback, all labelled SIMULATED where the data is simulated:

1. a simulated vLLM-style server (``ridgeline simulate --serve-metrics``): a real process
   with a real launch thread, serving the engine's Prometheus metrics;
2. the agent (``ridgeline agent``) with the live eBPF scheduling probe watching that
   process (when eBPF is available here; otherwise it says why and goes on), the engine
   probe scraping the simulated server's ``/metrics``, and as GPU-side source the same
   simulated engine (same seed and workload) generating kernels, copies and API calls;
3. ``ridgeline record`` saving the stream, and ``ridgeline top`` showing it for
   ``--duration`` seconds (works without a terminal: it then prints frames);
4. afterwards, from the recording: a report, a roofline plot and a Perfetto trace.

Everything lands in the output folder (default ``./demo-out``), which the command names
at the end.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ridgeline.agent.commands import description
from ridgeline.probes.errors import InputError


def register(sub) -> None:
    p = sub.add_parser("demo", help="run the whole pipeline on a simulated server (no GPU needed)",
                       description=description(__doc__) + " A simulated vLLM-style server, the agent, "
                       "`record` and `top` run on loopback, all labelled SIMULATED; then a report, a roofline "
                       "plot and a Perfetto trace land in the output folder.")
    p.add_argument("-o", "--output", default="demo-out", metavar="DIR", help="output folder (default: %(default)s)")
    p.add_argument("--duration", type=float, default=25.0, metavar="S", help="seconds to stream (default: %(default)s)")
    p.add_argument("--rate", type=float, default=6.0, help="simulated requests per second (default: %(default)s)")
    p.add_argument("--model", default="llama-3-8b", help="simulated model (default: %(default)s)")
    p.add_argument("--gpu", default="h100", help="simulated GPU (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ridgeline(*args: str) -> list[str]:
    return [sys.executable, "-m", "ridgeline", *args]


def _wait_line(proc: subprocess.Popen, needle: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        if needle in line:
            return line
    raise InputError(f"demo: the simulated server did not start (no '{needle}' within {timeout_s:g} s)")


def _stop(proc: subprocess.Popen | None, sig=signal.SIGTERM, timeout_s: float = 15) -> int | None:
    if proc is None or proc.poll() is not None:
        return None if proc is None else proc.returncode
    proc.send_signal(sig)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def demo_config(out: Path, endpoint: str, prom_port: int, sim_pid: int, sim_port: int, args,
                otlp_port: int = 0) -> str:
    otlp_probe = '"otlp", ' if otlp_port else ""
    otlp_section = ("\n[probes.otlp]\n# the simulated engine's per-request spans come here, as vLLM's would\n"
                    f'listen = "127.0.0.1:{otlp_port}"\njoin_delay_s = 2.0\n') if otlp_port else ""
    otlp_endpoint = f'otlp_endpoint = "http://127.0.0.1:{otlp_port}/v1/traces"' if otlp_port else ""
    return f"""# Written by `ridgeline demo`: the agent's configuration for this run.
[agent]
window_s = 1.0
# the demo stops the agent when it is done; this only ends one the demo left behind
run_for_s = {args.duration + 300:.1f}

[analysis]
model = "{args.model}"

[publisher]
endpoint = "{endpoint}"
publish_events = true
sndhwm = 10000

[prometheus]
listen = "127.0.0.1:{prom_port}"

[probes]
enabled = ["sched", {otlp_probe}"simulator", "engine"]
pids = [{sim_pid}]
{otlp_section}
[probes.engine]
url = "http://127.0.0.1:{sim_port}/metrics"

[probes.simulator]
gpu = "{args.gpu}"
model = "{args.model}"
rate_per_s = {args.rate}
seed = {args.seed}
pid = {sim_pid}
# the engine probe scrapes the served process: one engine for the one process
engine_metrics = false
{otlp_endpoint}
"""


def spans_available() -> str:
    """"" when the OpenTelemetry SDK and exporter (the extra ``otlp``) can be imported,
    else why not."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return ""


def run(args) -> int:
    if args.duration <= 0:
        raise InputError("--duration must be > 0")
    from ridgeline.agent.extras import require
    require("rich", "the demo's report")      # said before a minute of simulation, not after
    require("matplotlib", "the demo's roofline plot")
    out = Path(args.output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in ("stream.rlrec", "report.txt", "roofline.png", "trace.perfetto.json", "metrics.txt", "requests.json",
                "requests.txt"):
        (out / old).unlink(missing_ok=True)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    prom_port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: dict[str, subprocess.Popen] = {}
    print(f"ridgeline demo: SIMULATED {args.model} server on a simulated {args.gpu}, {args.rate:g} req/s; "
          f"output in {out}", flush=True)
    try:
        sim = subprocess.Popen(
            _ridgeline("simulate", "--serve-metrics", "0", "--rate", str(args.rate), "--seed", str(args.seed),
                       "--model", args.model, "--gpu", args.gpu, "--duration", "600"),
            stdout=subprocess.PIPE, stderr=open(out / "simulator.log", "w"), text=True, env=env)
        procs["simulator"] = sim
        line = _wait_line(sim, "metrics on http://127.0.0.1:", 60)
        sim_port = int(line.rsplit(":", 1)[1].split("/")[0])
        missing = spans_available()
        if missing:
            print(f"ridgeline demo: no per-request view: the OpenTelemetry SDK is not installed ({missing}); "
                  "install the extra `pip install 'ridgeline[otlp]'` to see `ridgeline requests`", flush=True)
        otlp_port = 0 if missing else free_port()
        (out / "agent.toml").write_text(demo_config(out, endpoint, prom_port, sim.pid, sim_port, args, otlp_port))
        agent_log = open(out / "agent.log", "w")
        procs["agent"] = subprocess.Popen(_ridgeline("agent", "--config", str(out / "agent.toml")),
                                          stdout=agent_log, stderr=subprocess.STDOUT, env=env)
        # Recorded until top and the request view are done (stopped below), not for a fixed
        # time from its own start: on a loaded host the agent can take longer to start than
        # such a time (a recording of 0-5 messages at load average 13).
        procs["record"] = subprocess.Popen(
            _ridgeline("record", "-o", str(out / "stream.rlrec"), "--endpoint", endpoint, "--duration", "0"),
            stdout=subprocess.DEVNULL, stderr=open(out / "record.log", "w"), env=env)
        # The live view, in this terminal (or printed frames without one).
        top = subprocess.run(_ridgeline("top", "--endpoint", endpoint, "--duration", str(args.duration),
                                        "--timeout", "30"), env=env)
        if top.returncode != 0:
            print(f"ridgeline demo: top ended with {top.returncode}; see {out / 'agent.log'}", file=sys.stderr)
        # /metrics first, while the agent surely runs (the requests view waits for windows)
        _scrape(prom_port, out / "metrics.txt")
        if otlp_port:
            _requests(endpoint, out, env)
        rc = _stop(procs["record"], signal.SIGTERM, 30)      # it keeps what it recorded
        if rc not in (0, None):
            print(f"ridgeline demo: record ended with {rc}; see {out / 'record.log'}", file=sys.stderr)
    finally:
        for name in ("record", "agent", "simulator"):
            _stop(procs.get(name), signal.SIGINT if name == "simulator" else signal.SIGTERM)
    _afterwards(out, args.model)
    return 0


def _requests(endpoint: str, out: Path, env: dict) -> None:
    """The per-request view: the slowest requests of the next windows, and the story of
    the slowest one (``ridgeline requests``, ``ridgeline why``), saved as requests.txt."""
    r = subprocess.run(_ridgeline("requests", "--endpoint", endpoint, "--windows", "3", "--limit", "5", "--json"),
                       env=env, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        print(f"ridgeline demo: requests ended with {r.returncode}: {r.stderr.strip()}", file=sys.stderr)
        return
    (out / "requests.json").write_text(r.stdout)
    import json
    doc = json.loads(r.stdout)
    from ridgeline.agent import request_view
    stories = request_view.load_json(str(out / "requests.json"))
    lines = ["", "ridgeline requests (SIMULATED requests, their spans sent through the OpenTelemetry SDK):",
             request_view.table(stories)]
    if doc["requests"]:
        rid = doc["requests"][0]["request_id"]
        why = subprocess.run(_ridgeline("why", rid, "--input", str(out / "requests.json")), env=env,
                             capture_output=True, text=True, timeout=60)
        lines += ["", f"ridgeline why {rid}:", why.stdout.rstrip() or why.stderr.rstrip()]
    text = "\n".join(lines) + "\n"
    (out / "requests.txt").write_text(text)
    print(text, flush=True)


def _scrape(port: int, path: Path) -> None:
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            path.write_text(r.read().decode("utf-8", "replace"))
    except OSError as exc:       # URLError, HTTPError and timeouts are all OSErrors
        path.write_text(f"# scrape failed: {exc}\n")


PERFETTO_LAST_S = 1.0


def last_seconds(trace, seconds: float):
    """The events of the trace's last ``seconds`` (a Perfetto file of the whole demo
    would be hundreds of MB; a few seconds show every step kind)."""
    from ridgeline.probes.events import Trace
    k = trace.kernels
    if not len(k):
        return trace
    t_cut = int(k["end_ns"].max() - seconds * 1e9)
    arrays = {n: getattr(trace, n)[getattr(trace, n)["start_ns"] >= t_cut] for n in
              ("kernels", "copies", "api", "ranges", "cpu_ops")}
    meta = dict(trace.meta, excerpt=f"last {seconds:g} s")
    return Trace(**arrays, names=trace.names, devices=trace.devices, meta=meta)


def _afterwards(out: Path, model_name: str) -> None:
    """Report, roofline plot and Perfetto trace from the recording."""
    from ridgeline.agent.recording import load_recording
    rec = load_recording(out / "stream.rlrec")
    trace = rec.trace
    trace.meta.setdefault("simulated", True)
    lines = [f"recording: {out / 'stream.rlrec'}: {sum(rec.messages.values())} messages "
             f"({', '.join(f'{t} {n}' for t, n in sorted(rec.messages.items()))}); "
             f"{len(trace.kernels)} SIMULATED kernels; sequence gaps {sum(rec.gaps.values())}"]
    from ridgeline.aggregator.answer import verdict_records
    from ridgeline.probes.records import window_of
    windows = [window_of(w) for w in rec.windows]     # the demo's own agent wrote them
    if windows:
        last = windows[-1].agent
        cpu = [w.agent.cpu_pct or 0 for w in windows]
        lines.append(f"agent cost while streaming: CPU median {sorted(cpu)[len(cpu) // 2]:.1f}% of one core, "
                     f"RSS {(last.rss_bytes or 0) / 2**20:.0f} MiB, dropped {last.dropped_records or 0} "
                     f"records, {last.dropped_batches or 0} batches")
        verdicts = [v["verdict"] for w in windows for v in verdict_records(w.verdict)]
        if verdicts:
            from collections import Counter
            lines.append("window verdicts: " + ", ".join(f"{v} x{n}" for v, n in Counter(verdicts).most_common()))
    if not len(trace.kernels):
        lines.append("no GPU events recorded; no roofline or Perfetto output")
        _write_report(out, lines, None)
        return
    from ridgeline.aggregator import model_config
    from ridgeline.aggregator.analysis import analyze_trace
    from ridgeline.aggregator.perfetto import write_perfetto
    from ridgeline.aggregator.phases import map_phases
    from ridgeline.aggregator.plot import plot_roofline
    from ridgeline.probes.records import PHASE_NAMES
    pm = map_phases(trace)
    model = model_config.load(model_name)
    doc = analyze_trace(trace, model=model, phase_map=pm)
    doc.trace = str(out / "stream.rlrec") + " (SIMULATED)"
    last_verdicts = verdict_records(windows[-1].verdict) if windows else []
    if last_verdicts:
        # the same window top, tail and /metrics showed last: the agent's judgement with the
        # engine and scheduler figures (the trace alone has neither)
        doc.answer = last_verdicts
        doc.answer_title = "Answer (the last window, as top, tail and /metrics showed it)"
    plot_roofline(doc, out / "roofline.png", title="ridgeline demo (SIMULATED)")
    excerpt = last_seconds(trace, PERFETTO_LAST_S)
    write_perfetto(excerpt, map_phases(excerpt), PHASE_NAMES, out / "trace.perfetto.json")
    _write_report(out, lines, doc)
    print(f"\nridgeline demo: done. Output folder {out}:")
    for name in ("report.txt", "requests.txt", "roofline.png", "trace.perfetto.json", "stream.rlrec", "metrics.txt",
                 "agent.log"):
        p = out / name
        if p.exists():
            print(f"  {p}  ({p.stat().st_size} bytes)")


def _write_report(out: Path, lines: list[str], doc) -> None:
    from rich.console import Console
    with open(out / "report.txt", "w") as f:
        console = Console(file=f, width=120, force_terminal=False)
        for line in lines:
            console.print(line)
        if doc is not None:
            from ridgeline.aggregator.report import render
            render(doc, console)
    print((out / "report.txt").read_text())
