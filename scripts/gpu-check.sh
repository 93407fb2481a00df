#!/usr/bin/env bash
# gpu-check.sh: judge Ridgeline's CUPTI path on one NVIDIA GPU, in one go.
#
#   bash scripts/gpu-check.sh --bundle
#       Where the package registry is reachable: builds build/gpu-check-bundle/, the wheels of
#       what the check imports beyond the standard library, numpy and torch (a torch 2.11 host
#       has those), for the host's Python only (3.12 by default: RIDGELINE_GPU_PYTHONS), at most
#       64 MiB, so it travels with the working tree (`run` carry: build/gpu-check-bundle).
#       Ridgeline itself is not in it: the check runs the working tree's code.
#   bash scripts/gpu-check.sh --preflight [OUTDIR]
#       On the GPU host, at most 30 s, needing no make: installs from the bundle only what the
#       host's Python cannot import (shadowing none of its own packages), builds the injection
#       library with cc, injects one kernel and sees its HELLO and record, and dumps the
#       versions and the PM-sampling metric list (scripts/gpu_preflight.py). Leaves
#       OUTDIR/gpu-check-preflight-<utc>.tar.gz. Without a GPU it is a dry run on the
#       stand-in libcupti, said so in every line.
#   bash scripts/gpu-check.sh [OUTDIR]
#       The preflight (its archive is written before anything long starts, so a later failure
#       still brings it back), then scripts/gpu_check.py (random-weight models), then
#       OUTDIR/gpu-check-<utc>.tar.gz. OUTDIR defaults to $OUT, else ./gpu-check-out. At most
#       6 minutes; it prints PASS/FAIL with the threshold of every point and exits 0 only when
#       all pass.
set -uo pipefail
cd "$(dirname "$0")/.."
BUNDLE=${RIDGELINE_GPU_BUNDLE:-build/gpu-check-bundle}
LIMIT_BYTES=$((64 << 20))
# Every Python Ridgeline runs on (>= 3.11, pyproject's requires-python) that torch 2.11 hosts
# ship. cupti-python cannot be imported without cuda-bindings (12 MB per version), which the
# hosts lack, so it comes for every version too; 3.10 is left out: Ridgeline needs tomllib.
# The host's Python (torch 2.11 wheels on the lent H200 host: 3.12); more with RIDGELINE_GPU_PYTHONS.
PYTHONS=${RIDGELINE_GPU_PYTHONS:-"3.12"}
# What the check imports beyond the standard library, numpy and torch: "wheel-requirement import-name".
# cuda-bindings comes only where asked (RIDGELINE_GPU_BINDINGS=1): the hosts have it, and it is 12 MB.
WHEELS="pyzmq==27.3.0:zmq orjson==3.13.0:orjson msgspec==0.23.0:msgspec msgpack==1.2.4:msgpack
google-re2==1.1.20251105:re2 isal==1.7.2:isal cupti-python==13.4.0:cupti"
PURE_WHEELS="cuda-pathfinder==1.9.1:cuda.pathfinder pyelftools==0.33:elftools"
say() { echo "gpu-check: $*"; }

bundle() {
    local py=${PYTHON:-python3}
    [ -x .venv/bin/python ] && py=.venv/bin/python
    rm -rf "$BUNDLE" && mkdir -p "$BUNDLE" || return 1
    local plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    local v reqs=() w
    for w in $WHEELS; do reqs+=("${w%%:*}"); done
    [ "${RIDGELINE_GPU_BINDINGS:-0}" = 1 ] && reqs+=(cuda-bindings==13.0.3)
    for v in $PYTHONS; do
        $py -m pip download -q --no-deps --only-binary=:all: "${plat[@]}" --implementation cp --python-version "$v" \
            -d "$BUNDLE" "${reqs[@]}" || { say "download for Python $v failed"; return 1; }
    done
    reqs=()
    for w in $PURE_WHEELS; do reqs+=("${w%%:*}"); done
    $py -m pip download -q --no-deps --only-binary=:all: -d "$BUNDLE" "${reqs[@]}" || return 1
    local size
    size=$(du -cb "$BUNDLE"/*.whl | tail -1 | cut -f1)
    say "bundle $BUNDLE: $(ls "$BUNDLE" | wc -l) wheels for Python $PYTHONS, $size bytes (limit $LIMIT_BYTES)"
    [ "$size" -le "$LIMIT_BYTES" ] || { say "FAILED: the bundle is over 64 MiB"; return 1; }
}

if [ "${1:-}" = "--bundle" ]; then
    bundle
    exit $?
fi

PREFLIGHT_ONLY=0
if [ "${1:-}" = "--preflight" ]; then
    PREFLIGHT_ONLY=1
    shift
fi
start=$(date +%s)
deadline=$((start + 360))                  # 6 minutes for everything, archive included
left() { echo $((deadline - $(date +%s))); }
OUTDIR=${1:-${OUT:-gpu-check-out}}
mkdir -p "$OUTDIR"
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
LOG="$WORK/gpu-check.log"
exec > >(tee -a "$LOG") 2>&1
archive() {    # $1: the archive's name stem
    local name
    name="$1-$(date -u +%Y%m%dT%H%M%SZ).tar.gz"
    tar czf "$OUTDIR/$name" -C "$WORK" --exclude=pydeps --exclude=tmp . && say "archive: $OUTDIR/$name"
}
if [ $PREFLIGHT_ONLY = 1 ]; then trap 'archive gpu-check-preflight' EXIT; else trap 'archive gpu-check' EXIT; fi

say "work folder $WORK, archive into $OUTDIR ($(date -u +%FT%TZ))"
{
  echo "## uname"; uname -a
  echo "## nvidia-smi"; (command -v nvidia-smi >/dev/null && nvidia-smi) || echo "nvidia-smi not found"
  echo "## nvcc"; (command -v nvcc >/dev/null && nvcc --version) || echo "no nvcc"
  echo "## compilers"; command -v cc gcc make || true
} > "$WORK/env.txt" 2>&1
PY=${PYTHON:-python3}
# an absolute path: the steps below run from the work folder (-s: a virtualenv's python is a link that must stay one)
case $PY in */*) PY=$(realpath -s "$PY") ;; esac
if ! $PY -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    say "FAILED: $PY is $($PY --version 2>&1): Ridgeline needs Python >= 3.11 (set PYTHON to the host's"
    say "        Python that has torch; the bundle carries wheels for $PYTHONS)"
    exit 2
fi
say "python: $PY ($($PY --version 2>&1))"
$PY -m pip list 2>/dev/null | grep -i -E "^(torch|nvidia-|cupti|cuda-|numpy|triton|pyzmq|orjson|msgspec|msgpack|google-re2|isal) " > "$WORK/pip.txt" || true

# 1. from the bundle, only what this Python cannot import, into a private folder: the host's
#    site-packages and libcupti are never touched, none of its packages is shadowed, nothing
#    is downloaded
if [ ! -d "$BUNDLE" ]; then
    say "FAILED: no wheel bundle at $BUNDLE (run 'bash scripts/gpu-check.sh --bundle' where the registry is reachable, and carry it)"
    exit 2
fi
DEPS="$WORK/pydeps"
missing=()
for w in $WHEELS $PURE_WHEELS cuda-bindings:cuda.bindings; do
    req=${w%%:*}; mod=${w##*:}
    $PY -c "import $mod" 2>/dev/null && { echo "host has $mod" >> "$WORK/deps.txt"; continue; }
    missing+=("${req%%==*}")
done
if [ ${#missing[@]} -gt 0 ]; then
    # one pip call: packages sharing a namespace folder (cuda/) must land together
    if $PY -m pip install -q --no-deps --no-index --find-links "$BUNDLE" --target "$DEPS" "${missing[@]}" \
            2>"$WORK/pip-install.log"; then
        say "installed from the bundle (the host lacked them): ${missing[*]}"
    else
        say "the bundle lacks a wheel for this Python ($(tail -1 "$WORK/pip-install.log")); installing what it has"
        for pkg in "${missing[@]}"; do
            $PY -m pip install -q --no-deps --no-index --find-links "$BUNDLE" --target "$DEPS" "$pkg" \
                >>"$WORK/pip-install.log" 2>&1 || say "no $pkg for this Python: what needs it fails with that reason"
        done
    fi
else
    say "the host has every package the check imports"
fi
# Ridgeline from this working tree, laid out as the wheel lays it out (package-dir map of
# pyproject.toml: agent/, probes/, aggregator/ under ridgeline/), so the code checked is the code here
mkdir -p "$DEPS/ridgeline"
cp -r ridgeline/. "$DEPS/ridgeline/" && for p in agent probes aggregator; do cp -r "$p" "$DEPS/ridgeline/$p"; done
find "$DEPS/ridgeline" -name __pycache__ -prune -exec rm -rf {} +
# appended, not prepended: a package the host has always wins over the bundle's
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$DEPS"
(cd "$WORK" && $PY -c "import ridgeline; print('gpu-check: ridgeline from', ridgeline.__file__)") \
    || say "ridgeline not importable from $DEPS"

# 2. the preflight: build with cc (no make), one injected kernel, versions, PM metric list
CUPTI_INCLUDE_DIR=$(cd "$WORK" && $PY -c "
import sys; sys.path.insert(0, '$PWD/scripts')
import os, gpu_preflight as g
d = g.cupti_include_dirs(dict(os.environ)); print(d[0] if d else '')" 2>/dev/null)
(cd "$WORK" && timeout --kill-after=5 40 $PY "$OLDPWD/scripts/gpu_preflight.py" --out "$WORK" --budget-s 30 \
    ${CUPTI_INCLUDE_DIR:+--cupti-include "$CUPTI_INCLUDE_DIR"})
pre=$?
if [ $PREFLIGHT_ONLY = 1 ]; then
    say "preflight done in $(( $(date +%s) - start )) s (rc $pre)"
    exit $pre
fi
archive gpu-check-preflight             # on disk before anything long starts
if [ $pre -ne 0 ]; then
    say "FAILED: the preflight did not pass (preflight.txt); the long points would only waste the GPU time"
    exit 1
fi
export RIDGELINE_CUPTI_LIB="$WORK/preflight/libridgeline_cupti.so"

# 3. the check itself
budget=$(( $(left) - 25 ))
say "running scripts/gpu_check.py (budget $budget s)"
# run from the work folder: the source tree's ridgeline/ must not shadow the installed one
timeout --kill-after=5 "$((budget + 10))" $PY "$PWD/scripts/gpu_check.py" --out "$WORK" --budget-s "$budget"
rc=$?
[ $rc -eq 124 ] && say "gpu_check.py ran out of time; partial results are in the archive"
say "done in $(( $(date +%s) - start )) s (rc $rc)"
exit $rc
