"""Where a peer's kernel names are matched against the signatures (issue 18.1): the agent's
main-loop CPU with the names matched there (no classifier: the phase mapper matches each
new name) against matched on the CUPTI probe's pump thread, side by side.

    .venv/bin/python bench/bench_name_classes.py [--batches 40] [--reps 3]

One process plays both threads: each batch of 8 new adversarial 4 kB names
(tests/support/adversarial_names.py, built for the trtllm-gen FMHA signatures) is ingested on a
thread of its own, as the pump does; then ``collect()`` and the phase mapper's
``classes()`` run here, timed with this thread's CPU clock. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from support import adversarial_names as A  # noqa: E402
from support import cupti_records as R  # noqa: E402

from ridgeline.aggregator.signatures import PeerNameClassifier, load_signatures  # noqa: E402
from ridgeline.aggregator.stream_phases import StreamPhaser  # noqa: E402
from ridgeline.probes.cupti import protocol as P  # noqa: E402
from ridgeline.probes.cupti.probe import CuptiProbe  # noqa: E402
from ridgeline.probes.cupti.server import Message  # noqa: E402

HDR = P.FRAME_DTYPE.itemsize


def messages(batches: int) -> list:
    base = [n for s in load_signatures() if s.id.startswith("trtllm_gen_fmha") for n in A.names_for(s.pattern, 4096)]
    b = R.make_buffer(8, seed=3, with_markers=False)
    out = [Message("hello", 1, 777, P.parse_hello(memoryview(R.hello_frame(pid=777))[HDR:]), 0, 65534)]
    for i in range(batches):
        names = {k: base[(i * 8 + j) % len(base)][:4080] + f"_{i}_{j}" for j, k in enumerate(b.names)}
        frame = R.batch_frame([(10, R.KERNEL.itemsize, b.kernels.tobytes())], names, pid=777)
        out.append(Message("batch", 1, 777, P.parse_batch(memoryview(frame)[HDR:]), 0))
    return out


def run(msgs: list, classifier: bool) -> tuple[float, float]:
    """(main-thread CPU s, pump-thread matching CPU s)."""
    p = CuptiProbe("/nonexistent/c.sock", name_classifier=PeerNameClassifier() if classifier else None)
    phaser, main = None, 0.0
    for m in msgs:
        t = threading.Thread(target=p.ingest, args=([m],))
        t.start()
        t.join()
        t0 = time.thread_time()
        got = p.collect()
        if "trace" in got:
            phaser = phaser or StreamPhaser(got["trace"].names)
            phaser.classes(got["trace"].kernels["name_id"])
        main += time.thread_time() - t0
    return main, p.counters()["classify_seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    msgs = messages(a.batches)
    got = {False: [], True: []}
    for _ in range(a.reps):
        for c in (False, True):          # alternated, so load changes hit both alike
            got[c].append(run(msgs, c))
    print(f"{a.batches * 8} names of ~4 kB in {a.batches} batches, median of {a.reps}\n")
    print("| names matched | main-loop CPU ms | pump-thread matching CPU ms |")
    print("|---|---|---|")
    for c, label in ((False, "on the main loop (no classifier)"), (True, "on the pump thread")):
        print(f"| {label} | {statistics.median(x[0] for x in got[c]) * 1e3:.1f} | "
              f"{statistics.median(x[1] for x in got[c]) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
