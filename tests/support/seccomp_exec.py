"""Run a command under a seccomp allow list, the way systemd applies SystemCallFilter=.

    /usr/bin/python3 tests/support/seccomp_exec.py ALLOWED_FILE -- CMD [ARGS...]

ALLOWED_FILE lists syscall names (whitespace-separated): those are allowed, every other
native syscall fails with EPERM (the unit's SystemCallErrorNumber=EPERM), and the filter
sets no_new_privs, as NoNewPrivileges=yes does. The filter is inherited across exec, so CMD
and its children run under it. Uses libseccomp's Python binding (Debian: python3-seccomp),
hence the distro interpreter; names this architecture lacks are skipped, as systemd does.
"""
import errno
import os
import sys

import seccomp


def main() -> int:
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    with open(sys.argv[1]) as fh:
        allowed = fh.read().split()
    flt = seccomp.SyscallFilter(defaction=seccomp.ERRNO(errno.EPERM))
    added = 0
    for name in allowed:
        try:
            flt.add_rule(seccomp.ALLOW, name)
            added += 1
        except (RuntimeError, ValueError, OSError):
            pass  # not a syscall of this architecture (e.g. arm_fadvise64_64 on x86-64)
    flt.load()
    print(f"seccomp_exec: {added} syscalls allowed, others fail with EPERM", file=sys.stderr, flush=True)
    cmd = sys.argv[3:]
    os.execvp(cmd[0], cmd)
    return 127


if __name__ == "__main__":
    sys.exit(main())
