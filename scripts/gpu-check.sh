#!/usr/bin/env bash
# gpu-check.sh: check Ridgeline's CUPTI path on a machine with an NVIDIA GPU, in one go
# (about 3-6 minutes; hard limit 9.5 minutes), and record everything for committing as
# test fixtures.
#
#   bash scripts/gpu-check.sh [OUTDIR]        (default: $OUT, else ./gpu-check-out)
#
# It detects what the machine has and degrades with a clear message at each step:
#   1. facts: nvidia-smi, driver, python, torch, CUDA toolkit, cupti-python
#   2. python environment: .venv if present, else the system python (+ pip install -e .
#      when numpy/msgpack/cupti-python are missing and an index is reachable)
#   3. builds probes/native (headers from the cupti wheel, a CUDA toolkit, or
#      `pip install nvidia-cuda-cupti`); a library carried in the working tree is used
#      when the build is impossible
#   4. scripts/gpu_check.py: workload plain / under `ridgeline run` / under torch.profiler,
#      comparisons, phase split, bandwidth, CPU cost per kernel, PM-sampling metric list
# Everything goes to OUTDIR: gpu_check.json, PROVENANCE.md, logs, recordings.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-${OUT:-gpu-check-out}}
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu-check.log"
exec > >(tee -a "$LOG") 2>&1
say() { echo "gpu-check: $*"; }
deadline=$(( $(date +%s) + 570 ))
left() { echo $(( deadline - $(date +%s) )); }

say "output in $OUTDIR ($(date -u +%FT%TZ))"
{
  echo "## uname"; uname -a
  echo "## nvidia-smi"; (command -v nvidia-smi >/dev/null && nvidia-smi) || echo "nvidia-smi not found"
  echo "## nvcc"; (command -v nvcc >/dev/null && nvcc --version) || ls -d /usr/local/cuda* 2>/dev/null || echo "no CUDA toolkit"
  echo "## compilers"; command -v cc gcc make || true
} > "$OUTDIR/env.txt" 2>&1
if ! command -v nvidia-smi >/dev/null && [ ! -e /dev/nvidiactl ]; then
    say "WARNING: no nvidia-smi and no /dev/nvidiactl: this does not look like a GPU machine; GPU steps will report why they fail"
fi

PY=python3
if [ -x .venv/bin/python ] && .venv/bin/python -c "import numpy" 2>/dev/null; then PY=.venv/bin/python; fi
say "python: $PY ($($PY --version 2>&1))"
if ! $PY -c "import numpy, msgpack, cupti" 2>/dev/null; then
    say "installing the project's pinned dependencies (numpy, msgpack, cupti-python, ...)"
    timeout 180 $PY -m pip install -q -e . 2>&1 | tail -3 || say "pip install failed: steps needing those modules will say so"
fi
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())" \
    2>&1 | sed 's/^/gpu-check: /' || true
$PY -m pip list 2>/dev/null | grep -i -E "^(torch|nvidia-|cupti|numpy|transformers) " > "$OUTDIR/pip.txt" || true

# build the injection library
CUPTI_INCLUDE_DIR=$($PY - <<'PYEOF' 2>/dev/null
import glob, sys
for sp in sys.path:
    for pat in ("nvidia/cu13/include", "nvidia/cuda_cupti/include"):
        for d in glob.glob(f"{sp}/{pat}"):
            if glob.glob(d + "/cupti_activity.h"):
                print(d); raise SystemExit
PYEOF
)
if [ -z "$CUPTI_INCLUDE_DIR" ] && [ ! -f /usr/local/cuda/include/cupti_activity.h ] && [ ! -f /usr/local/cuda/extras/CUPTI/include/cupti_activity.h ]; then
    say "no CUPTI headers: trying pip install nvidia-cuda-cupti"
    timeout 120 $PY -m pip install -q nvidia-cuda-cupti 2>&1 | tail -2 || true
    CUPTI_INCLUDE_DIR=$($PY -c "import glob,sys; print(next((d for sp in sys.path for d in glob.glob(sp+'/nvidia/*/include') if glob.glob(d+'/cupti_activity.h')), ''))" 2>/dev/null)
fi
if [ -n "$CUPTI_INCLUDE_DIR" ]; then
    make -s -C probes/native CUPTI_INCLUDE="$CUPTI_INCLUDE_DIR" && say "built probes/native against $CUPTI_INCLUDE_DIR"
else
    make -s -C probes/native && say "built probes/native against a CUDA toolkit"
fi
if [ ! -f probes/native/libridgeline_cupti.so ]; then
    say "FAILED: no injection library (no compiler or no CUPTI headers); injected steps will fail"
fi

say "running scripts/gpu_check.py (budget $(left) s)"
timeout --kill-after=10 "$(left)" $PY scripts/gpu_check.py --out "$OUTDIR" --budget-s "$(( $(left) - 20 ))"
rc=$?
[ $rc -eq 124 ] && say "gpu_check.py ran out of time; partial results are in $OUTDIR/gpu_check.json"
say "done (rc $rc); commit $OUTDIR as fixtures (tests/data/gpu-check/) with its PROVENANCE.md"
exit $rc
