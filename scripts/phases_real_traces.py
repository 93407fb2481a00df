"""Phase and step-count table of map_phases on every real trace the tests use (issue 20).

For each trace: the engine's steps (from its own step annotation, else the ProfilerStep
ranges), the steps found and the share of kernel time per phase with annotations kept,
stripped (every range removed), and stripped with the CPU operators removed too (kernels
only). Prints a Markdown table (docs/phases.md holds the last one).

With ``--verdicts``: a second table, for the traces whose model is a built-in shape
(aggregator/model_config.py), of each phase's verdict and work source in the three modes
with the analytic model (``~`` marks work estimated from token counts read off kernel grids).

    python scripts/phases_real_traces.py [--shared DIR] [--third-party DIR] [--verdicts]

Traces are read from SHARED/traces (tests/conftest.py SHARED) and from the third-party
folder (tests/THIRD_PARTY.md); absent files are listed as absent. A file the reader refuses
ends the run with one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from ridgeline.aggregator.phases import PHASE_NAMES, map_phases, parse_step_annotation
from ridgeline.probes.errors import InputError
from ridgeline.probes.events import CPU_OP_DTYPE, RANGE_DTYPE, Trace, empty
from ridgeline.probes.kineto import load_trace

ROOT = Path(__file__).resolve().parent.parent
SHARED_TRACES = ["nvidia-inference/tracelens_b200_vllm_gptoss_tp8_prefill888.json.gz",
                 "nvidia-inference/tracelens_h100_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz",
                 "nvidia-inference/nanovllm_rtx4080laptop_decode_step0_fragment.json.gz",
                 "nvidia-inference/nanovllm_rtx4080laptop_decode_step100_fragment.json.gz",
                 "nvidia-training/hta_a100_rank0_training.json.gz",
                 "nvidia-training/hta_a100_alexnet_benchmark.json.gz"]
THIRD_PARTY_TRACES = ["tracelens_mi300_sglang_qwen3_8b_decode.json.gz", "tracelens_mi300_sglang_qwen3_8b_extend.json.gz",
                      "tracelens_mi300_vllm_gptoss_decode_full.json.gz",
                      "tracelens_mi300_vllm_gptoss_mixed_piecewise.json.gz",
                      "tracelens_mi300_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz",
                      "tracelens_h100_bert_small_fill_mask.json.gz", "tracelens_mi300_bert_small_fill_mask.json.gz",
                      "tracelens_h100_vit_image_classification.json.gz", "tracelens_mi300_vit_image_classification.json.gz",
                      "tracelens_h100_timesformer_video_classification.json.gz",
                      "tracelens_h100_owlv2_zero_shot_detection.json.gz",
                      "tracelens_mi300_xdit_sd35_diffusion_transformer.json.gz"]


def without(tr: Trace, cpu_ops: bool) -> Trace:
    return Trace(kernels=tr.kernels, copies=tr.copies, api=tr.api, ranges=empty(RANGE_DTYPE),
                 cpu_ops=empty(CPU_OP_DTYPE) if not cpu_ops else tr.cpu_ops, names=tr.names, devices=tr.devices,
                 meta=tr.meta)


def engine_steps(tr: Trace) -> str:
    """What the trace itself says about its steps: engine step annotations (outermost
    nesting counted once: the phases of the innermost), else ProfilerStep ranges."""
    r = tr.ranges
    names = [tr.names[int(i)] for i in r["name_id"][r["device"] < 0]] if len(r) else []
    anns = [a for a in (parse_step_annotation(n) for n in names if not n.startswith("ProfilerStep#")) if a]
    sgl = [a for a in anns if a.engine == "sglang"]
    anns = sgl or anns
    if anns:
        return f"{len(anns)} " + "/".join(sorted({PHASE_NAMES[a.phase] for a in anns})) + " (annotation)"
    ps = sum(1 for n in names if n.startswith("ProfilerStep#"))
    tail = launched_before(tr)
    return (f"{ps} ProfilerStep" if ps else "?") + (f" + a tail of {tail} kernels" if ps and tail else "")


def launched_before(tr: Trace) -> int:
    """Kernels that ran before the first kernel whose launch the trace holds, with no launch
    of their own in it: the tail of an iteration launched before the recording began (the
    GPU runs behind the CPU; Kineto records activity from the step it starts in), a step of
    its own that no ProfilerStep range counts."""
    k, a = tr.kernels, tr.api
    if not len(k) or not len(a):
        return 0
    launched = np.isin(k["correlation_id"], a["correlation_id"])
    if not launched.any():
        return 0
    first = k["start_ns"][launched].min()
    return int((~launched & (k["start_ns"] < first)).sum())


def summary(tr: Trace, pm) -> tuple[str, str]:
    dur = (tr.kernels["end_ns"] - tr.kernels["start_ns"]).astype(np.float64)
    counts: dict[str, int] = {}
    for s in pm.steps:
        counts[s.phase_name] = counts.get(s.phase_name, 0) + 1
    steps = f"{len(pm.steps)} (" + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + ")"
    share = ", ".join(f"{PHASE_NAMES[i]} {dur[pm.kernel_phase == i].sum() / dur.sum():.0%}" for i in PHASE_NAMES
                      if (pm.kernel_phase == i).any())
    return steps, share


# Traces whose model is built in: (model, tensor parallel, GPU for the ceilings when the
# trace's device name is empty).
MODELS = {"tracelens_b200_vllm_gptoss_tp8_prefill888": ("gpt-oss-120b", 8, None),
          "tracelens_mi300_vllm_gptoss_decode_full": ("gpt-oss-20b", 1, "mi300x"),
          "tracelens_mi300_vllm_gptoss_mixed_piecewise": ("gpt-oss-20b", 1, "mi300x"),
          "tracelens_h100_hf_qwen1.5-0.5b_forward_bs16_seq559": ("qwen1.5-0.5b", 1, None),
          "tracelens_mi300_hf_qwen1.5-0.5b_forward_bs16_seq559": ("qwen1.5-0.5b", 1, "mi300x")}


def verdicts(tr: Trace, name: str) -> str | None:
    """One table row: per mode, each phase's verdict and work source (None: no built-in model)."""
    from ridgeline.aggregator import model_config
    from ridgeline.aggregator.analysis import analyze_trace
    if name not in MODELS:
        return None
    model, tp, gpu = MODELS[name]
    m = model_config.builtin(model)
    cells = []
    for t in (tr, without(tr, True), without(tr, False)):
        doc = analyze_trace(t, model=m, tensor_parallel=tp, gpu=gpu)
        cells.append(", ".join(f"{ph}: {f.verdict} ({'~' if f.work_estimated else ''}{f.work_source})"
                               for ph, f in doc.phases.items()))
    return f"| `{name}` | {model} (TP {tp}) | " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", default=os.environ.get("RIDGELINE_SHARED", str(ROOT.parent / "shared")))
    ap.add_argument("--third-party", default=os.environ.get("RIDGELINE_THIRD_PARTY", ""))
    ap.add_argument("--verdicts", action="store_true", help="also the verdict table (built-in models)")
    a = ap.parse_args(argv)
    tp = Path(a.third_party) if a.third_party else Path(a.shared) / "third-party"
    paths = [Path(a.shared) / "traces" / n for n in SHARED_TRACES] + [tp / "traces" / n for n in THIRD_PARTY_TRACES]
    print("| trace | kernels | engine steps | kept: steps | kept: kernel time | stripped: steps | stripped: kernel time "
          "| no CPU ops: steps | no CPU ops: kernel time |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for p in paths:
        if not p.exists():
            print(f"| `{p.name}` | absent | | | | | | | |")
            continue
        try:
            tr = load_trace(p)
        except InputError as e:
            print(f"phases_real_traces: {e}", file=sys.stderr)
            return 2
        cells = []
        for t in (tr, without(tr, True), without(tr, False)):
            cells += summary(tr, map_phases(t))
        print(f"| `{p.name.removesuffix('.json.gz')}` | {len(tr.kernels)} | {engine_steps(tr)} | " + " | ".join(cells) + " |",
              flush=True)
        if a.verdicts:
            rows.append(verdicts(tr, p.name.removesuffix(".json.gz")))
    if a.verdicts:
        print("\n| trace | model | kept: verdict (work) | stripped: verdict (work) | no CPU ops: verdict (work) |")
        print("|---|---|---|---|---|")
        for r in rows:
            if r is not None:
                print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
