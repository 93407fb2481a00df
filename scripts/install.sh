#!/usr/bin/env bash
# Install (or with --uninstall remove) the Ridgeline agent as a systemd service:
#   /opt/ridgeline/venv             dedicated virtualenv: ridgeline, its pinned dependencies and
#                                   the CUPTI injection library, built by the package build
#                                   (needs a C/C++ compiler, make and libsimdjson-dev: scripts/setup-native.sh)
#   /etc/systemd/system/ridgeline.service
#   /etc/tmpfiles.d/ridgeline.conf  runtime folder /run/ridgeline (0751)
#   /etc/ridgeline/agent.toml       default config (kept if already there, kept on uninstall)
# A reinstall keeps /etc/ridgeline's mode, the config, drop-ins (ridgeline.service.d/) and
# an edited unit (the new one goes beside it as ridgeline.service.ridgeline-new).
# Installing into / as root also sets up the eBPF prerequisites (scripts/setup-ebpf.sh:
# distro bcc, kernel headers, tracefs; never fatal) and links the distro bcc into the venv.
#
# Options:
#   --root DIR     install under DIR instead of / (tests, image builds); touches nothing else.
#                  The tree runs where it will be installed: the venv's launchers and
#                  activate scripts name /opt/ridgeline/venv, not DIR/opt/ridgeline/venv
#   --uninstall    remove what install put there (config stays; remove it by hand)
#   --python PY    interpreter for the virtualenv (default: python3)
#   --no-ebpf      skip scripts/setup-ebpf.sh (the bcc link into the venv is still made)
#   --extras LIST  optional extras too, comma-separated: terminal (rich: `ridgeline top`, the
#                  text report of `analyze`), plot (matplotlib: `analyze --plot`); `demo`
#                  needs both. The agent itself needs none (default: none)
# Environment: RIDGELINE_PIP_ARGS extra pip arguments, e.g. "--find-links DIR" or
#   "--index-url URL" for a mirror or an offline wheel folder. Not "--no-deps" (the agent
#   needs its pinned dependencies) nor "--no-build-isolation" (the build needs the pinned
#   setuptools and the CUPTI headers of its build requirements).
set -euo pipefail

ROOT=/
UNINSTALL=0
PY=python3
EBPF=1
EXTRAS=
while [ $# -gt 0 ]; do
    case "$1" in
        --root) ROOT=${2:?--root needs a folder}; shift 2 ;;
        --root=*) ROOT=${1#--root=}; shift ;;
        --uninstall) UNINSTALL=1; shift ;;
        --python) PY=${2:?--python needs an interpreter}; shift 2 ;;
        --no-ebpf) EBPF=0; shift ;;
        --extras) EXTRAS=${2:?--extras needs a list, e.g. terminal,plot}; shift 2 ;;
        --extras=*) EXTRAS=${1#--extras=}; shift ;;
        -h|--help) sed -n '2,/^set /{/^#/p}' "$0"; exit 0 ;;
        *) echo "install.sh: error: unknown option $1" >&2; exit 2 ;;
    esac
done

case "$EXTRAS" in
    ""|terminal|plot|terminal,plot|plot,terminal) ;;
    *) echo "install.sh: error: --extras takes terminal, plot or both (terminal,plot), not $EXTRAS" >&2; exit 2 ;;
esac

case " ${RIDGELINE_PIP_ARGS:-} " in
    *" --no-deps "*|*" --no-build-isolation "*)
        echo "install.sh: error: RIDGELINE_PIP_ARGS must not hold --no-deps (the agent needs its pinned dependencies) or --no-build-isolation (the build needs its pinned setuptools and CUPTI headers)" >&2
        exit 2 ;;
esac

SRC=$(cd "$(dirname "$0")/.." && pwd)
R=${ROOT%/}
PREFIX="$R/opt/ridgeline"
UNIT="$R/etc/systemd/system/ridgeline.service"
TMPF="$R/etc/tmpfiles.d/ridgeline.conf"
CONF="$R/etc/ridgeline/agent.toml"
LIVE=0
if [ "$R" = "" ] && command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then LIVE=1; fi

if [ "$UNINSTALL" = 1 ]; then
    if [ "$LIVE" = 1 ]; then
        systemctl disable --now ridgeline.service 2>/dev/null || true
    fi
    rm -f "$UNIT" "$UNIT.ridgeline-new" "$TMPF"
    rm -rf "$PREFIX"
    if [ "$LIVE" = 1 ]; then systemctl daemon-reload; fi
    echo "ridgeline: uninstalled from ${ROOT}; config kept at $CONF"
    exit 0
fi

if [ "$R" = "" ] && [ "$(id -u)" != 0 ]; then
    echo "install.sh: error: installing into / needs root (or use --root DIR)" >&2
    exit 2
fi

install -d -m 0755 "$PREFIX" "$(dirname "$UNIT")" "$(dirname "$TMPF")"
# Made 0750 once: a reinstall keeps the mode an admin gave it (install -d -m would reset it).
if [ ! -d "$(dirname "$CONF")" ]; then install -d -m 0750 "$(dirname "$CONF")"; fi
if [ ! -x "$PREFIX/venv/bin/python" ]; then
    "$PY" -m venv "$PREFIX/venv"
fi
if [ "$R" = "" ]; then
    bash "$SRC/scripts/setup-native.sh" || true   # gcc/g++/make/libsimdjson-dev for the native builds; pip says if still missing
fi
if [ "$R" = "" ] && [ "$EBPF" = 1 ]; then
    bash "$SRC/scripts/setup-ebpf.sh" || echo "ridgeline: eBPF prerequisites unavailable (see above); the eBPF probes will say why" >&2
fi
# The package build compiles the injection library (setup.py); a missing compiler stops
# here with the reason, not later at `ridgeline run`.
# shellcheck disable=SC2086
"$PREFIX/venv/bin/python" -m pip install -q ${RIDGELINE_PIP_ARGS:-} "$SRC${EXTRAS:+[$EXTRAS]}"
"$PREFIX/venv/bin/python" -m pip check -q >/dev/null || {
    "$PREFIX/venv/bin/python" -m pip check >&2 || true
    echo "install.sh: error: the virtualenv lacks ridgeline's pinned dependencies (see above)" >&2; exit 1; }
# -I: not the source tree's ridgeline/ from the current folder, the installed package.
"$PREFIX/venv/bin/python" -I - <<'EOF' || { echo "install.sh: error: the installed package has no CUPTI injection library" >&2; exit 1; }
from ridgeline.probes.cupti.library import library_path
lib = library_path()
assert lib.is_file(), lib
print(f"ridgeline: injection library {lib}")
EOF
bash "$SRC/scripts/link-bcc.sh" "$PREFIX/venv" || true
if [ "$R" != "" ]; then
    # pip and venv wrote DIR/opt/ridgeline/venv into the launchers' shebangs and the activate
    # scripts; the tree is for an image whose / is DIR, so they must name /opt/ridgeline/venv.
    # Only text files naming that folder are rewritten (the python links stay as they are).
    find "$PREFIX/venv/bin" -maxdepth 1 -type f -print0 | while IFS= read -r -d '' f; do
        if grep -qIF -- "$PREFIX/venv" "$f"; then
            sed -i "s|$PREFIX/venv|/opt/ridgeline/venv|g" "$f"
        fi
    done
fi
# The unit as last installed ($PRISTINE) tells our old unit from a local edit. An edited
# unit (or one this script cannot tell from an edit: no record of what it installed) is
# kept, the new one put beside it, and the admin told to move the edits to a drop-in,
# $UNIT.d/*.conf ('systemctl edit ridgeline'), which this script never touches.
PRISTINE="$PREFIX/share/ridgeline.service"
if [ -e "$UNIT" ] && ! cmp -s "$UNIT" "$SRC/systemd/ridgeline.service" \
        && { [ ! -e "$PRISTINE" ] || ! cmp -s "$UNIT" "$PRISTINE"; }; then
    install -m 0644 "$SRC/systemd/ridgeline.service" "$UNIT.ridgeline-new"
    echo "ridgeline: $UNIT has local edits: kept; the new unit is $UNIT.ridgeline-new (move the edits to a drop-in, $UNIT.d/local.conf, then replace the unit with it)" >&2
else
    install -m 0644 "$SRC/systemd/ridgeline.service" "$UNIT"
    rm -f "$UNIT.ridgeline-new"
fi
install -d -m 0755 "$PREFIX/share"
install -m 0644 "$SRC/systemd/ridgeline.service" "$PRISTINE"
install -m 0644 "$SRC/systemd/ridgeline.conf" "$TMPF"
if [ ! -e "$CONF" ]; then
    install -m 0640 "$SRC/agent/data/agent.toml" "$CONF"
fi
if [ "$LIVE" = 1 ]; then
    systemd-tmpfiles --create "$TMPF" || true
    systemctl daemon-reload
    echo "ridgeline: installed. Start it with: systemctl enable --now ridgeline"
else
    echo "ridgeline: installed under $ROOT"
fi
