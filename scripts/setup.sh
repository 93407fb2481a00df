#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: system prerequisites, then the project's virtualenv.
# Fast when already done: each step checks before it acts.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PY:-python3}
# apt_install: waits for the dpkg lock, keeps apt's errors (scripts/apt.sh).
# shellcheck source=scripts/apt.sh
. scripts/apt.sh

# 1. System prerequisites (eBPF: distro bcc, kernel headers, tracefs). Never fatal:
#    without them Ridgeline still runs, the eBPF probes report why they are unavailable.
if [ -x scripts/setup-ebpf.sh ]; then
    bash scripts/setup-ebpf.sh || echo "ridgeline setup: eBPF prerequisites unavailable (see above); continuing without eBPF" >&2
fi
if [ -x scripts/setup-native.sh ]; then
    bash scripts/setup-native.sh || echo "ridgeline setup: native build tools unavailable; continuing" >&2
fi

# systemd-analyze: the unit tests verify systemd/ridgeline.service and score its sandboxing.
if ! command -v systemd-analyze >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt_install systemd \
        || echo "ridgeline setup: could not install systemd-analyze; unit tests will skip" >&2
fi

# Prometheus' own tools (Debian package `prometheus`: promtool and the server): the tests
# lint /metrics with `promtool check metrics`, check and unit-test deploy/prometheus rules,
# and run a real server against the agent on the simulator. Never fatal: those tests skip.
# Without recommends (node-exporter, smartmontools, ipmitool...: a second daemon on :9100
# and ~35 packages the tests do not use). The tests start their own server on a free port,
# so the package's service, which its postinst enables and starts where systemd runs, is
# stopped and disabled again when this script installed it.
if ! command -v promtool >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    if apt_install prometheus; then
        if [ -d /run/systemd/system ]; then
            systemctl disable --now prometheus.service >/dev/null 2>&1 || true
        fi
    else
        echo "ridgeline setup: could not install prometheus (promtool); its tests will skip" >&2
    fi
fi

# strace and libseccomp's Python binding: tests/test_systemd_filter.py records the probes'
# syscalls and runs them under the unit's SystemCallFilter. Never fatal: those tests skip.
if { ! command -v strace >/dev/null 2>&1 || ! /usr/bin/python3 -c 'import seccomp' >/dev/null 2>&1; } \
        && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt_install strace python3-seccomp \
        || echo "ridgeline setup: could not install strace/python3-seccomp; the syscall filter tests will skip" >&2
fi

# The distro's containers-common seccomp profile (what a container runtime's RuntimeDefault
# is): tests/test_deploy.py shows from it why the DaemonSet ships its own profile. Only that
# file is taken out of the package (its dependencies pull in a container network stack the
# tests do not need). Never fatal: that test skips.
if [ ! -f /usr/share/containers/seccomp.json ] && [ ! -f "$VENV/share/containers-common/seccomp.json" ] \
        && command -v apt-get >/dev/null 2>&1 && command -v dpkg-deb >/dev/null 2>&1; then
    cc_tmp="$(mktemp -d)" || cc_tmp=/nonexistent
    # apt-get download takes no dpkg lock (the update waits for it); the first try's errors
    # are shown when the retry fails too.
    if ( cd "$cc_tmp" && { apt-get download -q golang-github-containers-common >/dev/null 2>"$cc_tmp/err" \
            || { [ "$(id -u)" = 0 ] && apt-get update -q -o "DPkg::Lock::Timeout=$APT_LOCK_TIMEOUT_S" >/dev/null \
                 && apt-get download -q golang-github-containers-common >/dev/null; }; } ) \
            && dpkg-deb -x "$cc_tmp"/golang-github-containers-common_*.deb "$cc_tmp/x" \
            && [ -f "$cc_tmp/x/usr/share/containers/seccomp.json" ]; then
        install -D -m 0644 "$cc_tmp/x/usr/share/containers/seccomp.json" "$VENV/share/containers-common/seccomp.json"
    else
        [ -s "$cc_tmp/err" ] && sed 's/^/    /' "$cc_tmp/err" >&2
        echo "ridgeline setup: could not fetch the containers-common seccomp profile; one deploy test will skip" >&2
    fi
    [ "$cc_tmp" = /nonexistent ] || rm -rf "$cc_tmp"
fi

# 2. Virtualenv with pinned dependencies; reinstall only when pyproject.toml changed.
stamp="$VENV/.ridgeline-installed"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    # pip's exit status survives the filter (pipefail); the filter drops noise about
    # local index folders this machine's pip config names but does not have.
    # setuptools' 10-line "Editable installation ... folders with the same name as your
    # package" warning is about exactly this tree (ridgeline/ is the package): not shown.
    PYTHONWARNINGS="ignore:Editable installation" \
        "$VENV/bin/python" -m pip install -q -e '.[test,otlp,terminal,plot]' 2>&1 | { grep -v '^WARNING: Location' || true; }
    touch "$stamp"
fi

# 3. Let the venv import the distro's bcc module (python3-bpfcc), never PyPI's unrelated `bcc`.
if [ -x scripts/link-bcc.sh ]; then
    bash scripts/link-bcc.sh "$VENV" || true
fi

# 4. Native parts (CUPTI injection library, trace reader), when the project has them.
if [ -f probes/native/Makefile ]; then
    make -s -C probes/native || echo "ridgeline setup: native library build failed (see above); CUPTI probe unavailable" >&2
fi
# The native trace reader (libsimdjson-dev from scripts/setup-native.sh): `analyze` and
# every trace import need it, and say so when it is missing.
if [ -f probes/native_json/Makefile ]; then
    make -s -C probes/native_json || echo "ridgeline setup: native trace reader build failed (see above); trace imports will say it is missing" >&2
fi
# The native CUPTI decode passes (probes/cupti/native, a C compiler only): the agent's
# CUPTI probe decodes with them and says so when they are missing.
if ! make -s -C probes/cupti/native; then
    echo "ridgeline setup: building the native CUPTI decoder (probes/cupti/native) failed (see above)" >&2
    exit 1
fi
# The scheduling probe's slot free (probes/sched_native, a C compiler only): a compare-and-swap
# on the mmapped slot table; the eBPF scheduling probe says so and does not start without it.
if ! make -s -C probes/sched_native; then
    echo "ridgeline setup: building the scheduling slot library (probes/sched_native) failed (see above)" >&2
    exit 1
fi
# The native fold library (aggregator/native): the agent and analyze cannot fold without it.
if ! make -s -C aggregator/native; then
    echo "ridgeline setup: building the native fold library (aggregator/native) failed (see above)" >&2
    exit 1
fi
