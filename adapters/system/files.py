"""Files a user hands to `refit`, opened so that nothing but a regular file is ever read.

A FIFO, a terminal or a socket given where a file is expected would block the command forever
(`open` of a FIFO waits for a writer, a read of a terminal for input), and a device could be
endless. `open_regular` opens with O_NONBLOCK, so the open itself never waits, then refuses
anything `fstat` does not call a regular file, all on one descriptor (no window between a check
and the open). Its errors are `OSError`s whose `strerror` says what the path is instead, so each
caller reports them as it reports any unreadable file, under its own key.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFLNK: "a symlink",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFREG: "a regular file"}


def kind(mode: int) -> str:
    """What a file mode (`st_mode`) is, in words: "a FIFO", "a symlink", "a regular file", ..."""
    return _KINDS.get(stat.S_IFMT(mode), "of an unknown kind")


def open_regular(path: str | Path) -> int:
    """Open a regular file for reading (symlinks followed), never blocking.

    Args:
        path: the file.

    Returns:
        A descriptor (blocking mode restored); the caller closes it. Raises OSError when the path
        cannot be opened or is not a regular file (`strerror`: "is a FIFO, not a regular file").
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"is {kind(mode)}, not a regular file", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | Path) -> bytes:
    """The whole content of a regular file (see `open_regular` for what is refused).

    Args:
        path: the file.

    Returns:
        Its bytes. Raises OSError as `open_regular` does, or when reading fails.
    """
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        return f.read()
