#!/usr/bin/env bash
# setup-ebpf.sh: system prerequisites of Ridgeline's eBPF probes (bcc), idempotent.
#
#   sudo bash scripts/setup-ebpf.sh
#
# What it makes true, each step checking before it acts (a second run takes well under a second):
#   1. the distro bcc (python3-bpfcc) and a kernel header tree are installed
#      (never PyPI's `bcc`, an unrelated project);
#   2. tracefs is mounted (TRACEPOINT_PROBE reads events/<cat>/<ev>/{id,format});
#   3. /lib/modules/$(uname -r)/{build,source} exist: bcc needs *a* header tree even for
#      tracepoint and uprobe programs. When the distro ships no headers for the running
#      kernel (custom or VM kernels), the distro's current headers are linked instead.
#      That is safe only because the probes never dereference kernel structs through
#      those headers (tracepoint args and BTF-derived offsets only).
#   4. a smoke test compiles and attaches one program, once per kernel/bcc version
#      (stamp in /var/lib/ridgeline), so the fast path stays fast.
# The project's virtualenv is linked to the distro bcc by scripts/link-bcc.sh.
#
# Exit status: 0 when eBPF is usable; 1 with a one-line reason when it cannot be
# (not root, no BPF/BTF, apt unavailable). scripts/setup.sh carries on either way.
# Env: RIDGELINE_EBPF_CHECK=1 forces the smoke test; RIDGELINE_EBPF_CHECK=0 skips it.
set -euo pipefail

log() { printf '[setup-ebpf] %s\n' "$*" >&2; }
fail() { log "eBPF unavailable: $*"; exit 1; }

[ "$(uname -s)" = Linux ] || fail "not Linux"
[ "$(id -u)" = 0 ] || fail "needs root (apt packages, tracefs mount, /lib/modules links); rerun with sudo"
[ -e /sys/kernel/btf/vmlinux ] || fail "kernel has no BTF (/sys/kernel/btf/vmlinux missing; CONFIG_DEBUG_INFO_BTF)"
[ -e /proc/sys/kernel/unprivileged_bpf_disabled ] || fail "kernel has no bpf() syscall (CONFIG_BPF_SYSCALL)"
command -v dpkg-query >/dev/null || fail "not a Debian-family system (no dpkg); install bcc's python bindings and kernel headers by hand"

# One set-up at a time: several engineers or CI jobs may call this at once.
# The lock is a flock on a directory's descriptor, opened read-only: nothing is created or
# truncated through a name another user could have prepared (a symlink at
# /run/lock/ridgeline-setup-ebpf.lock truncated its target where fs.protected_symlinks is
# off, as in containers). The directory is root's own, 0700, never a symlink (issue 18.8).
LOCKDIR=/run/ridgeline-setup
[ -d /run ] && [ -w /run ] || LOCKDIR=/root/.ridgeline-setup
[ -L "$LOCKDIR" ] && fail "$LOCKDIR is a symbolic link; refusing to use it as the set-up lock"
mkdir -p -m 0700 "$LOCKDIR" || fail "cannot create the set-up lock directory $LOCKDIR"
[ ! -L "$LOCKDIR" ] && [ "$(stat -c %u "$LOCKDIR")" = 0 ] || fail "$LOCKDIR is not root's own directory; refusing it as the lock"
exec 9<"$LOCKDIR"
flock -w 300 9 || fail "another setup-ebpf.sh holds the lock for 5 minutes"

KREL="$(uname -r)"
KDIR="/lib/modules/$KREL"
ARCH="$(dpkg --print-architecture)"
changed=0

installed() { dpkg-query -W -f='${Status}\n' "$1" 2>/dev/null | grep -q '^install ok installed$'; }
have_real_headers() {
  [ -f "$KDIR/build/include/generated/autoconf.h" ] &&
  { [ -f "$KDIR/source/include/linux/kconfig.h" ] || [ -f "$KDIR/build/include/linux/kconfig.h" ]; } &&
  ! readlink "$KDIR/build" | grep -q "^/usr/src/linux-headers-.*-$ARCH\$" 2>/dev/null
}
apt_has() { apt-cache show "$1" >/dev/null 2>&1; }

# ------------------------------------------------------------------- 1. packages
want="python3-bpfcc"
if ! have_real_headers; then
  # Headers of exactly this kernel when the distro has them, else the distro's current
  # headers (linked in step 3).
  # (apt-cache is slow: ask it only when neither header package is installed yet.)
  if installed "linux-headers-$KREL" || { ! installed "linux-headers-$ARCH" && apt_has "linux-headers-$KREL"; }; then
    want="$want linux-headers-$KREL"
  else
    want="$want linux-headers-$ARCH"
  fi
fi
missing=""
for p in $want; do installed "$p" || missing="$missing $p"; done
if [ -n "$missing" ]; then
  command -v apt-get >/dev/null || fail "apt-get missing; cannot install$missing"
  export DEBIAN_FRONTEND=noninteractive
  apt_install() { apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=120 $missing >/dev/null; }
  # Refresh the package lists only when needed: lists absent, a package unknown, or an
  # install that fails because a listed .deb has been superseded (security updates
  # replace the linux-headers ABI packages, and the old ones then 404).
  need_update=0
  ls /var/lib/apt/lists/*_Packages >/dev/null 2>&1 || need_update=1
  for p in $missing; do apt_has "$p" || need_update=1; done
  if [ $need_update = 1 ]; then
    log "apt-get update"
    apt-get update -qq -o DPkg::Lock::Timeout=120 || fail "apt-get update failed (no network to the distro mirror?)"
  fi
  log "installing:$missing"
  if ! apt_install; then
    [ $need_update = 1 ] && fail "apt-get install$missing failed"
    log "install failed with current lists; apt-get update and retry"
    apt-get update -qq -o DPkg::Lock::Timeout=120 || fail "apt-get update failed"
    apt_install || fail "apt-get install$missing failed"
  fi
  changed=1
fi

# ------------------------------------------------------------------- 2. tracefs
if [ ! -d /sys/kernel/tracing/events ] && [ ! -d /sys/kernel/debug/tracing/events ]; then
  mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null || fail "cannot mount tracefs on /sys/kernel/tracing"
  log "mounted tracefs on /sys/kernel/tracing"
  changed=1
fi

# ------------------------------------------------------------------- 3. headers
if ! have_real_headers; then
  if installed "linux-headers-$KREL" && [ -d "$KDIR/build" ]; then
    :   # the distro's own headers for this kernel; their package made the links
  else
    # The flavour the meta package depends on now, e.g. linux-headers-6.1.0-57-amd64.
    HREL="$(dpkg-query -W -f='${Depends}\n' "linux-headers-$ARCH" 2>/dev/null |
            sed -n "s/.*linux-headers-\([^ ,]*-$ARCH\).*/\1/p" | head -n1)"
    if [ -z "$HREL" ] || [ ! -d "/usr/src/linux-headers-$HREL" ]; then
      HREL="$(ls -1d /usr/src/linux-headers-*-"$ARCH" 2>/dev/null | sed 's#.*/linux-headers-##' | sort -V | tail -n1)"
    fi
    [ -n "$HREL" ] || fail "no linux-headers-*-$ARCH tree installed"
    BUILD="$(readlink -f "/lib/modules/$HREL/build" 2>/dev/null || true)"
    SOURCE="$(readlink -f "/lib/modules/$HREL/source" 2>/dev/null || true)"
    [ -d "$BUILD" ] || BUILD="/usr/src/linux-headers-$HREL"
    [ -d "$SOURCE" ] || SOURCE="/usr/src/linux-headers-${HREL%-"$ARCH"}-common"
    [ -f "$BUILD/include/generated/autoconf.h" ] && [ -f "$SOURCE/include/linux/kconfig.h" ] ||
      fail "header tree incomplete: $BUILD / $SOURCE"
    if [ "$(readlink "$KDIR/build" || true)" != "$BUILD" ] || [ "$(readlink "$KDIR/source" || true)" != "$SOURCE" ]; then
      mkdir -p "$KDIR" 2>/dev/null || fail "$KDIR is not writable (read-only /lib/modules: set BCC_KERNEL_SOURCE to a merged header tree)"
      ln -sfn "$BUILD" "$KDIR/build"
      ln -sfn "$SOURCE" "$KDIR/source"
      log "kernel $KREL has no distro headers; linked $KDIR/{build,source} -> $HREL headers"
      changed=1
    fi
  fi
fi

# ------------------------------------------------------------------- 4. smoke test
BCC_VER="$(dpkg-query -W -f='${Version}' python3-bpfcc 2>/dev/null || echo none)"
STAMP_DIR=/var/lib/ridgeline
STAMP="$STAMP_DIR/ebpf-ok"
SIG="$KREL $BCC_VER $(readlink "$KDIR/build" 2>/dev/null || echo real)"
check="${RIDGELINE_EBPF_CHECK:-auto}"
if [ "$check" = 1 ] || { [ "$check" = auto ] && { [ $changed = 1 ] || [ "$(cat "$STAMP" 2>/dev/null || true)" != "$SIG" ]; }; }; then
  /usr/bin/python3 - <<'EOF' || fail "smoke test failed: bcc cannot compile/attach a sched_switch program (see above)"
import sys, time
from bcc import BPF
b = BPF(text=r"""
BPF_ARRAY(n, u64, 1);
TRACEPOINT_PROBE(sched, sched_switch) { int k = 0; n.increment(k); return 0; }
""")
time.sleep(0.1)
c = b["n"][0].value
b.cleanup()
if c <= 0:
    sys.exit("[setup-ebpf] no sched_switch events seen in 0.1 s")
print("[setup-ebpf] bcc OK (%d sched_switch in 0.1 s)" % c, file=sys.stderr)
EOF
  mkdir -p "$STAMP_DIR" && printf '%s\n' "$SIG" > "$STAMP"
fi
log "ready (kernel $KREL, bcc $BCC_VER)"
