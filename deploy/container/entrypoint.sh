#!/usr/bin/env bash
# Entrypoint of the Ridgeline agent image: `ridgeline ARGS...`, after giving bcc a kernel
# header tree the way scripts/setup-ebpf.sh does on a host (step 3 there):
#   1. the node's own headers, when the pod mounts the node's /lib/modules and /usr/src
#      under /host (deploy/kubernetes/daemonset.yaml does);
#   2. else the image's distro headers (linux-headers-<arch>): safe only because the probes
#      never dereference kernel structs through headers (tracepoint arguments and
#      BTF-derived offsets only).
# The links go into /lib/modules/$(uname -r), an emptyDir in the DaemonSet (the root file
# system stays read-only). Nothing here is fatal: without headers the eBPF probes report
# why and the agent runs the other probes.
set -euo pipefail
log() { printf 'ridgeline-entrypoint: %s\n' "$*" >&2; }

KREL="$(uname -r)"
KDIR="/lib/modules/$KREL"
HOST="${RIDGELINE_HOST_ROOT:-/host}"

headers_ok() { [ -f "$1/include/generated/autoconf.h" ]; }
# A symlink target on the node, seen through $HOST.
on_host() { local t; t="$(readlink "$1" 2>/dev/null || true)"; case "$t" in /*) printf '%s%s' "$HOST" "$t" ;; *) printf '%s' "$1" ;; esac; }

link_headers() {
    if headers_ok "$KDIR/build"; then
        return 0                                   # already there (node headers mounted at /lib/modules)
    fi
    local build="" source=""
    if [ -L "$HOST/lib/modules/$KREL/build" ] || [ -e "$HOST/lib/modules/$KREL/build" ]; then
        build="$(on_host "$HOST/lib/modules/$KREL/build")"
        source="$(on_host "$HOST/lib/modules/$KREL/source")"
        headers_ok "$build" || build=""
    fi
    if [ -z "$build" ]; then
        local arch
        arch="$(dpkg --print-architecture 2>/dev/null || echo amd64)"
        build="$(ls -1d /usr/src/linux-headers-*-"$arch" 2>/dev/null | sort -V | tail -n1 || true)"
        [ -n "$build" ] || { log "no kernel headers (node's or image's); eBPF probes will say why"; return 0; }
        source="${build%-"$arch"}-common"
        log "node has no headers for $KREL under $HOST; using the image's $(basename "$build")"
    fi
    [ -d "$source" ] || source="$build"
    if ! mkdir -p "$KDIR" 2>/dev/null || ! ln -sfn "$build" "$KDIR/build" 2>/dev/null; then
        log "$KDIR is not writable (mount an emptyDir on /lib/modules); eBPF probes may lack headers"
        return 0
    fi
    ln -sfn "$source" "$KDIR/source"
}

if [ "$(id -u)" = 0 ]; then          # agent, sched, check: whatever loads BPF programs
    link_headers
fi
exec /opt/ridgeline/venv/bin/ridgeline "$@"
