"""Output files opened without following links: ``open_output(path)``.

``analyze --perfetto/--plot`` and ``record -o`` often run as root, in folders other
users can write (/tmp). A plain ``open(path, "wb")`` follows a symbolic link another user
left at that name and truncates its target (/etc/shadow), or writes through a hard link
to a file root owns. So:

* the last component is opened with ``O_NOFOLLOW`` (a symlink there fails with ELOOP);
* an existing file is used only if it is a regular file with one link (a hard link to
  another file is refused), and it is truncated only after those checks, through the
  descriptor checked (no race between the check and the write);
* ``O_NONBLOCK`` at open, so a FIFO left at the name cannot block (it is refused).

Any refusal is :class:`InputError`, one line naming the file.
"""
from __future__ import annotations

import errno
import os
import stat

from .errors import InputError


def open_output(path, what: str = "output") -> "os.FileIO":
    """A binary file object open for writing at ``path``, created 0644 or truncated."""
    p = os.fspath(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(p, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InputError(f"{p}: is a symbolic link; refusing to write the {what} through it "
                             "(remove it or choose another name)") from None
        raise InputError(f"{p}: cannot write the {what}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{p}: is not a regular file; refusing to write the {what} there")
        if st.st_nlink > 1:
            raise InputError(f"{p}: has {st.st_nlink} hard links; refusing to write the {what} through it "
                             "(remove it or choose another name)")
        os.ftruncate(fd, 0)
        os.set_blocking(fd, True)
    except InputError:
        os.close(fd)
        raise
    except OSError as exc:
        os.close(fd)
        raise InputError(f"{p}: cannot write the {what}: {exc.strerror or exc}") from None
    return os.fdopen(fd, "wb")
