# shellcheck shell=bash
# Sourced by scripts/setup.sh and scripts/setup-native.sh: one way to install Debian packages.
#
# apt_install PKG...  installs without recommends. It waits up to 60 s for the dpkg lock
# (another apt run, unattended-upgrades at boot) instead of failing at once, refreshes the
# package lists once when the install fails with the current ones, and keeps apt's errors:
# stdout is quiet, but when both tries fail their stderr is printed (indented) before the
# failure status is returned. The caller says what the failure means.
APT_LOCK_TIMEOUT_S=${APT_LOCK_TIMEOUT_S:-60}

apt_install() {
    local err rc=0
    err=$(mktemp) || return 1
    if DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
            -o "DPkg::Lock::Timeout=$APT_LOCK_TIMEOUT_S" "$@" >/dev/null 2>"$err"; then
        rm -f "$err"; return 0
    fi
    { apt-get update -q -o "DPkg::Lock::Timeout=$APT_LOCK_TIMEOUT_S" >/dev/null 2>>"$err" \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
            -o "DPkg::Lock::Timeout=$APT_LOCK_TIMEOUT_S" "$@" >/dev/null 2>>"$err"; } || rc=$?
    if [ "$rc" != 0 ]; then
        echo "apt-get install $* failed:" >&2
        sed 's/^/    /' "$err" >&2
    fi
    rm -f "$err"
    return "$rc"
}
