"""Publish a directory atomically, replacing only what was checked.

`refit export` writes into a private temporary directory beside the destination, then calls
`publish`: with `renameat2(2)` (Linux 3.15+) the new directory either takes the place of an
absent destination (RENAME_NOREPLACE: fails if anything appeared there) or is swapped with the
existing one in one step (RENAME_EXCHANGE); the swapped-out directory is then compared with the
state checked before the export started and swapped back if anything changed. Where the kernel
or the file system lacks renameat2, plain renames are used after a final check (a window of
microseconds, still under the destination's lock, `adapters.system.ownership.DestinationLock`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
from pathlib import Path
from typing import Any

import attrs

from domain.errors import OutputChanged

_AT_FDCWD = -100
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_UNSUPPORTED = (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP)


def _renameat2() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # not glibc >= 2.28, or not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _renameat2()


def _rename2(src: Path, dst: Path, flags: int) -> bool:
    """renameat2(src, dst, flags); False when the kernel or file system does not support it."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`, failing with FileExistsError if `dst` exists (of any kind)."""
    if _rename2(src, dst, _RENAME_NOREPLACE):
        return
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, "exists", str(dst))
    os.rename(src, dst)


def exchange(a: Path, b: Path) -> None:
    """Swap two existing paths (atomically where renameat2 is available)."""
    if _rename2(a, b, _RENAME_EXCHANGE):
        return
    aside = a.with_name(a.name + ".swap")
    os.rename(b, aside)
    os.rename(a, b)
    os.rename(aside, a)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (created, renamed files) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Remove a file, a symlink or a directory tree; nothing when it is gone."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@attrs.frozen
class DirState:
    """What a destination was when it was checked: absent, or a directory with this identity
    and these entries (relative path, size, modification time; directories with size -1)."""

    exists: bool
    identity: tuple[int, int] | None = None
    entries: tuple[tuple[str, int, int], ...] = ()

    @classmethod
    def of(cls, path: Path) -> DirState:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return cls(False)
        entries = []
        if not os.path.islink(path) and os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                for name in sorted(dirs) + sorted(files):
                    full = os.path.join(root, name)
                    s = os.lstat(full)
                    size = -1 if name in dirs else s.st_size
                    entries.append((os.path.relpath(full, path), size, s.st_mtime_ns))
        return cls(True, (st.st_dev, st.st_ino), tuple(sorted(entries)))

    @property
    def empty(self) -> bool:
        return not self.entries


def publish(tmp: Path, dest: Path, checked: DirState) -> None:
    """Put the complete directory `tmp` at `dest`, replacing only what `checked` describes.

    Args:
        tmp: the finished directory (beside `dest`, on the same file system).
        dest: the destination.
        checked: `DirState.of(dest)` taken when the destination was checked.

    Returns:
        None. Afterwards `dest` is the new directory and what it replaced is removed. Raises
        OutputChanged (and leaves `dest` as it found it) when `dest` is no longer what was
        checked: something created it, or changed, replaced or removed it.
    """
    if not checked.exists:
        try:
            rename_noreplace(tmp, dest)
        except FileExistsError:
            raise OutputChanged(
                f"--out {str(dest)!r} was created by someone else while the export ran; it was left as it is"
            ) from None
    else:
        if not os.path.lexists(dest):
            raise OutputChanged(f"--out {str(dest)!r} was removed while the export ran; nothing was written there")
        exchange(tmp, dest)
        if DirState.of(tmp) != checked:
            exchange(tmp, dest)
            raise OutputChanged(
                f"--out {str(dest)!r} changed while the export ran (files were added, changed or removed); "
                "it was left as it is: check it, then export again"
            )
        remove(tmp)
    fsync_dir(dest.parent)
