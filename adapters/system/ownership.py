"""The lock and the partial directory of one export, who owns them, and when they may be removed.

An export to `D/NAME` holds the lock `D/.NAME.lock` and writes into `D/.NAME.partial-TOKEN`.

- The lock file appears complete or not at all: it is written unnamed (O_TMPFILE), flocked, then
  linked into place, which fails if anything (a file, a symlink, a directory) is already there,
  so nothing is ever followed or overwritten. It holds an owner record: rl-refit's marker, the
  pid, the host (hostname, boot id, pid namespace), the process's start time, and a random token.
- The token, also kept in memory, names the partial directory; mkdir creates it exclusively
  (it neither replaces nor follows anything), and only the directory it made is removed.
- An existing lock is taken over only when it carries the marker, nobody holds its flock, and its
  owner is provably dead: the same host, and a pid that is not running or runs with another start
  time. Then the partial directory its record names is removed (never a protected directory, such
  as the model, nor anything inside or around one), then the lock. Anything else at the lock's
  place is refused (`ForeignLockFile`); a live or unprovable owner is `OutputBusy`. Nothing is
  ever removed by its name alone.

Where the file system has no O_TMPFILE or no hard links, the lock is created in place
(O_CREAT | O_EXCL | O_NOFOLLOW) and flocked and written at once; a process killed in between
leaves an empty lock file, which a later export refuses, naming it, as not its own.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs

from adapters.system.files import kind
from domain.errors import ForeignLockFile, OutputBusy

MARKER = "rl-refit export lock"
_RECORD_BYTES = 4096  # a record is a few hundred bytes; a longer file is not one
_ATTEMPTS = 8  # takeovers in a row before giving up (each needs another export to interfere)
_O_TMPFILE = getattr(os, "O_TMPFILE", None)
_DEFERRED = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
# O_TMPFILE or linking it is not supported here (kernel, file system, no /proc): create in place
_NO_TMPFILE = {errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT, errno.EPERM, errno.EMLINK}


def _first_line(path: str) -> str:
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return ""


def _machine() -> tuple[str, str, str]:
    """This host as an owner record names it: hostname, boot id, pid namespace (Linux; else "")."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return socket.gethostname(), _first_line("/proc/sys/kernel/random/boot_id"), namespace


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot, /proc/PID/stat field 22); None where unknown."""
    text = _first_line(f"/proc/{pid}/stat")
    try:
        return int(text.rpartition(")")[2].split()[19])
    except (IndexError, ValueError):
        return None


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@attrs.frozen
class Owner:
    """The owner record of a lock: which process on which host holds it, and its token.

    Attributes:
        start: the process's start time (`process_start`), None where unknown.
        token: 32 hex digits, random; it names the owner's partial directory.
    """

    pid: int = attrs.field(validator=[attrs.validators.instance_of(int), attrs.validators.gt(0)])
    host: str = attrs.field(validator=attrs.validators.instance_of(str))
    boot_id: str = attrs.field(validator=attrs.validators.instance_of(str))
    pid_namespace: str = attrs.field(validator=attrs.validators.instance_of(str))
    start: int | None = attrs.field(validator=attrs.validators.optional(attrs.validators.instance_of(int)))
    token: str = attrs.field(validator=attrs.validators.matches_re(r"[0-9a-f]{32}"))

    @classmethod
    def current(cls) -> Owner:
        """This process, with a fresh token."""
        host, boot_id, namespace = _machine()
        return cls(os.getpid(), host, boot_id, namespace, process_start(os.getpid()), secrets.token_hex(16))

    def to_bytes(self) -> bytes:
        return (json.dumps({"marker": MARKER, **attrs.asdict(self)}) + "\n").encode()

    @classmethod
    def parse(cls, data: bytes) -> Owner | None:
        """The record in a lock file's bytes; None when they are not one (no marker, malformed)."""
        try:
            fields = json.loads(data.decode("utf-8"))
            if not isinstance(fields, dict) or fields.pop("marker", None) != MARKER:
                return None
            return cls(**fields)
        except (UnicodeDecodeError, ValueError, RecursionError, TypeError):
            return None

    def provably_dead(self) -> bool:
        """True only when this host is the owner's (same hostname, boot and pid namespace) and its
        pid is not running, or is running with another start time (a reused pid)."""
        if (self.host, self.boot_id, self.pid_namespace) != _machine():
            return False  # its pids mean nothing here
        if not _running(self.pid):
            return True
        start = process_start(self.pid)
        return start is not None and self.start is not None and start != self.start

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}"


def partial_path(dest: Path, token: str) -> Path:
    """The partial directory of the export to `dest` whose lock holds `token`."""
    return dest.with_name(f".{dest.name}.partial-{token}")


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _holds(fd: int, path: Path) -> bool:
    """Whether `path` is (still) the file open as `fd`."""
    st = os.fstat(fd)
    return _identity(path) == (st.st_dev, st.st_ino)


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


class _Unsupported(Exception):
    """This file system (or kernel) cannot create and link an unnamed file."""


def _write_locked(fd: int, record: bytes) -> None:
    fcntl.flock(fd, fcntl.LOCK_EX)  # blocking: one that inspects a new file holds it for an instant
    os.pwrite(fd, record, 0)


def _link_unnamed(record: bytes, path: Path) -> int | None:
    """Write `record` to a new unnamed file in `path`'s directory, flock it, and link it as `path`.

    Returns:
        Its descriptor; None when something is already at `path`. Raises _Unsupported where
        O_TMPFILE or linking it is not supported, OSError on other failures.
    """
    if _O_TMPFILE is None:
        raise _Unsupported
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = os.open(".", _O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o644, dir_fd=directory)
    except OSError as err:
        os.close(directory)
        if err.errno not in _NO_TMPFILE:
            raise
        raise _Unsupported from None
    try:
        _write_locked(fd, record)
        # dst_dir_fd makes os.link call linkat(AT_SYMLINK_FOLLOW): the file, not the /proc link
        os.link(f"/proc/self/fd/{fd}", path.name, dst_dir_fd=directory)
        return fd
    except OSError as err:
        os.close(fd)
        if isinstance(err, FileExistsError):
            return None
        if err.errno not in _NO_TMPFILE:
            raise
        raise _Unsupported from None
    finally:
        os.close(directory)


def _create(path: Path, record: bytes) -> int | None:
    """Create the lock file `path` holding `record`, flocked by the returned descriptor; None when
    something is already there."""
    try:
        return _link_unnamed(record, path)
    except _Unsupported:
        pass
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        return None
    try:
        _write_locked(fd, record)
    except BaseException:
        os.unlink(path)  # ours: O_EXCL made it
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _uninterrupted() -> Iterator[None]:
    """Defer SIGINT, SIGTERM and SIGHUP (which `refit` turns into exceptions) for a few system
    calls, so that a file made there is always recorded before an exception can leave."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _DEFERRED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class DestinationLock:
    """The exclusive lock of one destination while an export to it runs, and the partial directory
    it owns (see the module docstring).

    Args:
        dest: the destination path (its parent directory must exist).
        protected: directories that a takeover never removes, nor anything inside or above them
            (the model's).
    """

    def __init__(self, dest: Path, protected: Sequence[Path] = ()) -> None:
        self.dest = dest
        self.path = dest.with_name(f".{dest.name}.lock")
        self.protected = tuple(Path(os.path.realpath(p)) for p in protected)
        self.owner: Owner | None = None
        self._fd: int | None = None
        self._partial_fd: int | None = None

    def __enter__(self) -> DestinationLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove_partial()
        self.release()

    @property
    def partial(self) -> Path:
        """The partial directory of this lock's owner (`.NAME.partial-TOKEN`); needs the lock held."""
        if self.owner is None:
            raise RuntimeError(f"the lock {self.path} is not held; acquire it first")
        return partial_path(self.dest, self.owner.token)

    def acquire(self) -> None:
        """Take the lock, taking over a dead export's (and removing its partial directory).

        Raises OutputBusy when a live export holds it (or its owner cannot be proven dead),
        ForeignLockFile when something rl-refit did not create is in its place, OSError when the
        lock file cannot be created.
        """
        owner = Owner.current()
        for _ in range(_ATTEMPTS):
            with _uninterrupted():
                fd = _create(self.path, owner.to_bytes())
                if fd is not None:
                    self._fd, self.owner = fd, owner
                    return
            self._take_over()
        raise OutputBusy(f"the lock {str(self.path)!r} of --out {str(self.dest)!r} kept changing hands: other exports "
                         "to it are starting; wait for them, or choose another --out")

    def create_partial(self) -> Path:
        """Create the partial directory (exclusively: never an existing path, never through a symlink).

        Returns:
            Its path. Raises FileExistsError when something is already there.
        """
        path = self.partial
        with _uninterrupted():
            os.mkdir(path)
            # held open, so that its inode cannot be reused by a directory made in its place
            self._partial_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        return path

    def remove_partial(self) -> None:
        """Remove the partial directory, if it is still the one `create_partial` made."""
        if self._partial_fd is None:
            return
        if _holds(self._partial_fd, self.partial):
            shutil.rmtree(self.partial, ignore_errors=True)
        os.close(self._partial_fd)
        self._partial_fd = None

    def release(self) -> None:
        """Remove the lock file, if it is still ours, and release the lock (nothing when not held)."""
        if self._fd is None:
            return
        if _holds(self._fd, self.path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)  # while still holding it: nobody takes it over meanwhile
        os.close(self._fd)
        self._fd = self.owner = None

    # --- another export's lock ---------------------------------------------------------------

    def _take_over(self) -> None:
        """Something is at the lock's place: remove it when it is a dead export's lock (and the
        partial directory it names); raise otherwise. Returns when the place may be free."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return  # released meanwhile
        except OSError as err:
            if err.errno not in (errno.ELOOP, errno.ENXIO):  # not a symlink or a socket: say why
                raise self._foreign(f"cannot be read ({err.strerror})") from None
            try:
                what = kind(os.lstat(self.path).st_mode)
            except FileNotFoundError:
                return
            raise self._foreign(f"is {what}") from None
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise self._foreign(f"is {kind(mode)}")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise self._busy(Owner.parse(os.pread(fd, _RECORD_BYTES, 0))) from None
            if not _holds(fd, self.path):
                return  # replaced meanwhile: look again
            owner = Owner.parse(os.pread(fd, _RECORD_BYTES, 0))
            if owner is None:
                raise self._foreign("holds no rl-refit owner record")
            if not owner.provably_dead():
                raise self._unprovable(owner)
            self._remove_dead_partial(owner)
            os.unlink(self.path)  # holding its flock: no other export takes it over meanwhile
        finally:
            os.close(fd)

    def _remove_dead_partial(self, owner: Owner) -> None:
        partial = partial_path(self.dest, owner.token)
        try:
            mode = os.lstat(partial).st_mode
        except FileNotFoundError:
            return
        real = Path(os.path.realpath(partial))
        if stat.S_ISDIR(mode) and not any(_inside(real, p) or _inside(p, real) for p in self.protected):
            shutil.rmtree(partial)

    def _foreign(self, what: str) -> ForeignLockFile:
        return ForeignLockFile(
            f"{str(self.path)!r} {what}: it is no lock rl-refit made; export keeps the lock of --out {str(self.dest)!r} "
            "there and never removes what it did not create: move it away, or choose another --out"
        )

    def _busy(self, owner: Owner | None) -> OutputBusy:
        who = owner.describe() if owner is not None else f"the holder of {str(self.path)!r}"
        return OutputBusy(f"another export to --out {str(self.dest)!r} is running ({who}); wait for it to finish, "
                          "or choose another --out")

    def _unprovable(self, owner: Owner) -> OutputBusy:
        return OutputBusy(
            f"--out {str(self.dest)!r} is locked by an export ({owner.describe()}) that may still run: it is on another "
            "host, boot or pid namespace, or its pid is alive; wait for it, or choose another --out; if you know it "
            f"is gone, remove {str(self.path)!r} and {str(partial_path(self.dest, owner.token))!r}"
        )
