#!/usr/bin/env bash
# link-bcc.sh VENV: let a virtualenv import the distro's bcc (python3-bpfcc).
#
# bcc's Python package is pure Python and loads libbcc.so.0 with ctypes, so any CPython 3
# can use it; the project's venv may run another build of the interpreter (e.g. pyenv
# 3.11.7 while the distro's is 3.11.2). Only the `bcc` package is symlinked into the venv's
# site-packages: no other distro package leaks in (unlike --system-site-packages or a
# .pth file). Never `pip install bcc`: PyPI's `bcc` is an unrelated project.
# Idempotent; exit 0 with a note when the distro bcc is absent (eBPF probes then report
# themselves unavailable), 1 on a real error (bad venv).
set -euo pipefail
log() { printf '[link-bcc] %s\n' "$*" >&2; }

VENV="${1:?usage: link-bcc.sh VENV}"
PY="$VENV/bin/python"
[ -x "$PY" ] || { log "not a virtualenv: $VENV"; exit 1; }

SRC=""
for d in /usr/lib/python3/dist-packages/bcc /usr/lib/python3*/site-packages/bcc; do
  [ -f "$d/__init__.py" ] && { SRC="$d"; break; }
done
if [ -z "$SRC" ]; then
  log "distro bcc not installed (python3-bpfcc); run scripts/setup-ebpf.sh as root. eBPF probes stay unavailable."
  exit 0
fi

SP="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
DST="$SP/bcc"
if [ -L "$DST" ] && [ "$(readlink "$DST")" = "$SRC" ]; then
  exit 0    # already linked: the fast path
fi
if [ -e "$DST" ] && [ ! -L "$DST" ]; then
  # A real directory here is PyPI's unrelated `bcc` (or a copy): do not shadow it silently.
  log "$DST exists and is not the distro bcc (PyPI 'bcc'?); remove it with '$PY -m pip uninstall bcc' and rerun"
  exit 1
fi
ln -sfn "$SRC" "$DST"
"$PY" -c 'import bcc; assert hasattr(bcc, "BPF")' || { log "linked $DST but 'import bcc' fails in $PY"; exit 1; }
log "linked distro bcc into $DST"
