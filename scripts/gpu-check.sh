#!/usr/bin/env bash
# gpu-check.sh: judge Ridgeline's CUPTI path on one NVIDIA GPU (issue 10, points a-i), in one go.
#
#   bash scripts/gpu-check.sh --bundle
#       On a machine that reaches the package registry: builds build/gpu-check-bundle/, the
#       wheels a GPU host lacks (pyzmq, orjson, cupti-python and what it imports: cuda-bindings,
#       cuda-pathfinder, pyelftools) for Python 3.11-3.13; at most 64 MiB, so it travels with the
#       working tree (`run` carry: build/gpu-check-bundle). Ridgeline itself is not in it: the
#       check runs the working tree's code (a wheel built earlier would be stale after any change).
#   bash scripts/gpu-check.sh [OUTDIR]
#       On the GPU host, air-gapped: installs the bundle into a private folder (pip --no-index
#       --no-deps --target: the host's site-packages and its libcupti are never touched; nothing
#       is downloaded), builds probes/native against the host's CUPTI headers, runs
#       scripts/gpu_check.py (random-weight models) and leaves exactly one archive,
#       OUTDIR/gpu-check-<utc>.tar.gz (OUTDIR defaults to $OUT, else ./gpu-check-out).
#       The whole check takes at most 6 minutes; it prints PASS/FAIL with the threshold of
#       every point and exits 0 only when all pass.
set -uo pipefail
cd "$(dirname "$0")/.."
BUNDLE=${RIDGELINE_GPU_BUNDLE:-build/gpu-check-bundle}
LIMIT_BYTES=$((64 << 20))
# Every Python Ridgeline runs on (>= 3.11, pyproject's requires-python) that torch 2.11 hosts
# ship. cupti-python cannot be imported without cuda-bindings (12 MB per version), which the
# hosts lack, so it comes for every version too; 3.10 is left out: Ridgeline needs tomllib.
PYTHONS=${RIDGELINE_GPU_PYTHONS:-"3.11 3.12 3.13"}
BINDINGS_PYTHONS=${RIDGELINE_GPU_BINDINGS_PYTHONS:-$PYTHONS}
say() { echo "gpu-check: $*"; }

bundle() {
    local py=${PYTHON:-python3}
    [ -x .venv/bin/python ] && py=.venv/bin/python
    rm -rf "$BUNDLE" && mkdir -p "$BUNDLE" || return 1
    local plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    local v
    for v in $PYTHONS; do
        $py -m pip download -q --no-deps --only-binary=:all: "${plat[@]}" --implementation cp --python-version "$v" \
            -d "$BUNDLE" pyzmq==27.3.0 orjson==3.13.0 cupti-python==13.4.0 || { say "download for Python $v failed"; return 1; }
    done
    for v in $BINDINGS_PYTHONS; do
        $py -m pip download -q --no-deps --only-binary=:all: "${plat[@]}" --implementation cp --python-version "$v" \
            -d "$BUNDLE" cuda-bindings==13.0.3 || { say "cuda-bindings for Python $v failed"; return 1; }
    done
    $py -m pip download -q --no-deps --only-binary=:all: -d "$BUNDLE" cuda-pathfinder==1.9.1 pyelftools==0.33 || return 1
    local size
    size=$(du -cb "$BUNDLE"/*.whl | tail -1 | cut -f1)
    say "bundle $BUNDLE: $(ls "$BUNDLE" | wc -l) wheels, $size bytes (limit $LIMIT_BYTES)"
    [ "$size" -le "$LIMIT_BYTES" ] || { say "FAILED: the bundle is over 64 MiB"; return 1; }
}

if [ "${1:-}" = "--bundle" ]; then
    bundle
    exit $?
fi

start=$(date +%s)
deadline=$((start + 360))                  # 6 minutes for everything, archive included
left() { echo $((deadline - $(date +%s))); }
OUTDIR=${1:-${OUT:-gpu-check-out}}
mkdir -p "$OUTDIR"
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
LOG="$WORK/gpu-check.log"
exec > >(tee -a "$LOG") 2>&1
archive() {
    local name
    name="gpu-check-$(date -u +%Y%m%dT%H%M%SZ).tar.gz"
    tar czf "$OUTDIR/$name" -C "$WORK" --exclude=pydeps --exclude=tmp . && say "archive: $OUTDIR/$name"
}
trap archive EXIT

say "work folder $WORK, archive into $OUTDIR ($(date -u +%FT%TZ))"
{
  echo "## uname"; uname -a
  echo "## nvidia-smi"; (command -v nvidia-smi >/dev/null && nvidia-smi) || echo "nvidia-smi not found"
  echo "## nvcc"; (command -v nvcc >/dev/null && nvcc --version) || echo "no nvcc"
  echo "## compilers"; command -v cc gcc make || true
} > "$WORK/env.txt" 2>&1
PY=${PYTHON:-python3}
if ! $PY -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    say "FAILED: $PY is $($PY --version 2>&1): Ridgeline needs Python >= 3.11 (set PYTHON to the host's"
    say "        Python 3.11-3.13 that has torch; the bundle carries wheels for $PYTHONS)"
    exit 2
fi
say "python: $PY ($($PY --version 2>&1)); torch: $($PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())' 2>&1 | tail -1)"
$PY -m pip list 2>/dev/null | grep -i -E "^(torch|nvidia-|cupti|cuda-|numpy|triton|pyzmq|orjson) " > "$WORK/pip.txt" || true

# 1. the wheels the host lacks, into a private folder (never the host's site-packages)
if [ ! -d "$BUNDLE" ]; then
    say "FAILED: no wheel bundle at $BUNDLE (run 'bash scripts/gpu-check.sh --bundle' where the registry is reachable, and carry it)"
    exit 2
fi
DEPS="$WORK/pydeps"
# one pip call: packages sharing a namespace folder (cuda/) must land together
pkgs="pyzmq orjson cuda-pathfinder pyelftools cupti-python"
$PY -c "import cuda.bindings" 2>/dev/null || pkgs="$pkgs cuda-bindings"
if ! $PY -m pip install -q --no-deps --no-index --find-links "$BUNDLE" --target "$DEPS" $pkgs 2>"$WORK/pip-install.log"; then
    say "the bundle lacks a wheel for this Python ($(tail -1 "$WORK/pip-install.log")); installing what it has"
    for pkg in $pkgs; do
        $PY -m pip install -q --no-deps --no-index --find-links "$BUNDLE" --target "$DEPS/$pkg" "$pkg" \
            >>"$WORK/pip-install.log" 2>&1 && PYTHONPATH="$DEPS/$pkg${PYTHONPATH:+:$PYTHONPATH}" \
            || say "no $pkg for this Python: the points needing it will fail with that reason"
    done
fi
# Ridgeline from this working tree, laid out as the wheel lays it out (package-dir map of
# pyproject.toml: agent/, probes/, aggregator/ under ridgeline/), so the code checked is the code here
mkdir -p "$DEPS/ridgeline"
cp -r ridgeline/. "$DEPS/ridgeline/" && for p in agent probes aggregator; do cp -r "$p" "$DEPS/ridgeline/$p"; done
find "$DEPS/ridgeline" -name __pycache__ -prune -exec rm -rf {} +
export PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}"
(cd "$WORK" && $PY -c "import ridgeline, zmq, orjson; print('gpu-check: ridgeline from', ridgeline.__file__)") \
    || say "ridgeline, pyzmq or orjson not importable from the bundle"

# 2. the injection library, against the host's CUPTI headers (the host's libcupti is used as is)
CUPTI_INCLUDE_DIR=$($PY - <<'PYEOF' 2>/dev/null
import glob, sys
for sp in sys.path:
    for pat in ("nvidia/cu13/include", "nvidia/cuda_cupti/include"):
        for d in glob.glob(f"{sp}/{pat}"):
            if glob.glob(d + "/cupti_activity.h"):
                print(d); raise SystemExit
PYEOF
)
# a toolkit: where CUDA_HOME/CUDA_PATH or nvcc say, else the usual places; runfile installs put
# CUPTI under extras/CUPTI/include, packages under targets/<arch>/include (include/ links there)
nvcc_root=$(command -v nvcc >/dev/null && dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
for root in ${CUDA_HOME:-} ${CUDA_PATH:-} $nvcc_root /usr/local/cuda /usr/local/cuda-13* /usr/local/cuda-12* /opt/nvidia/cuda; do
    for sub in extras/CUPTI/include include targets/x86_64-linux/include targets/sbsa-linux/include; do
        d="$root/$sub"
        [ -z "$CUPTI_INCLUDE_DIR" ] && [ -f "$d/cupti_activity.h" ] && CUPTI_INCLUDE_DIR=$d
    done
done
if [ -n "$CUPTI_INCLUDE_DIR" ]; then
    make -s -C probes/native CUPTI_INCLUDE="$CUPTI_INCLUDE_DIR" > "$WORK/make.log" 2>&1 \
        && say "built probes/native against $CUPTI_INCLUDE_DIR" || say "FAILED to build probes/native (make.log)"
else
    say "FAILED: no CUPTI headers on this host (nvidia-cuda-cupti wheel or /usr/local/cuda)"
fi
export RIDGELINE_CUPTI_LIB="$PWD/probes/native/libridgeline_cupti.so"

# 3. the check itself
budget=$(( $(left) - 25 ))
say "running scripts/gpu_check.py (budget $budget s)"
# run from the work folder: the source tree's ridgeline/ must not shadow the installed wheel
timeout --kill-after=5 "$((budget + 10))" $PY "$PWD/scripts/gpu_check.py" --out "$WORK" --budget-s "$budget"
rc=$?
[ $rc -eq 124 ] && say "gpu_check.py ran out of time; partial results are in the archive"
say "done in $(( $(date +%s) - start )) s (rc $rc)"
exit $rc
