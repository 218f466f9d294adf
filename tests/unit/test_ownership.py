"""The destination lock and its owner record: it is created whole or not at all (with O_TMPFILE
and in place), refuses a second holder, is taken over only from a provably dead owner (whose
partial directory goes with it), and nothing rl-refit did not create is ever removed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import attrs
import pytest

from adapters.system import ownership
from adapters.system.ownership import DestinationLock, Owner, partial_path, process_start
from domain.errors import ForeignLockFile, OutputBusy


@pytest.fixture(params=["O_TMPFILE", "in place"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "O_TMPFILE" and ownership._O_TMPFILE is None:
        pytest.skip("this platform has no O_TMPFILE")
    if request.param == "in place":
        monkeypatch.setattr(ownership, "_O_TMPFILE", None)
    return request.param


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _leave(out: Path, owner: Owner) -> Path:
    """What an export killed while it wrote leaves: its lock and its partial directory (with a shard)."""
    out.with_name(f".{out.name}.lock").write_bytes(owner.to_bytes())
    partial = partial_path(out, owner.token)
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    return partial


def _tree(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): (os.readlink(p) if p.is_symlink() else p.read_text() if p.is_file() else "/")
            for p in sorted(path.rglob("*"))}


def test_the_lock_holds_its_owner_and_refuses_a_second_holder(mode: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with DestinationLock(out) as first:
        owner = Owner.parse(first.path.read_bytes())
        assert owner == first.owner and owner is not None and owner.pid == os.getpid()
        assert owner.start == process_start(os.getpid()) and not owner.provably_dead()
        assert first.partial == tmp_path / f".out.partial-{owner.token}"
        with pytest.raises(OutputBusy, match=f"is running \\(pid {os.getpid()} on host"):
            DestinationLock(out).acquire()
        first.create_partial()
        assert sorted(p.name for p in tmp_path.iterdir()) == [".out.lock", first.partial.name]
    assert list(tmp_path.iterdir()) == []
    with DestinationLock(out):  # free again
        pass


def test_the_lock_file_appears_with_its_record(mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    visible_before_written = []
    real = ownership._write_locked

    def spy(fd: int, record: bytes) -> None:
        visible_before_written.append(os.path.lexists(tmp_path / ".out.lock"))
        real(fd, record)

    monkeypatch.setattr(ownership, "_write_locked", spy)
    with DestinationLock(tmp_path / "out"):
        pass
    assert visible_before_written == [mode == "in place"]  # O_TMPFILE: linked only once written


@pytest.mark.parametrize("death", ["pid gone", "pid reused"])
def test_a_dead_owners_lock_and_partial_are_taken_over(death: str, mode: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    me = Owner.current()
    dead = attrs.evolve(me, pid=_dead_pid()) if death == "pid gone" else attrs.evolve(me, start=(me.start or 0) + 1)
    assert dead.provably_dead()
    partial = _leave(out, dead)
    with DestinationLock(out) as lock:
        assert not partial.exists() and lock.owner is not None and lock.owner.token != dead.token
        assert Owner.parse(lock.path.read_bytes()) == lock.owner


@pytest.mark.parametrize("who", ["another host", "another boot", "another pid namespace", "alive"])
def test_an_owner_not_provably_dead_keeps_its_lock(who: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    field = {"another host": "host", "another boot": "boot_id", "another pid namespace": "pid_namespace"}.get(who)
    owner = Owner.current() if field is None else attrs.evolve(Owner.current(), **{field: "elsewhere"})
    partial = _leave(out, attrs.evolve(owner, pid=_dead_pid()) if field else owner)
    before = _tree(tmp_path)
    with pytest.raises(OutputBusy, match=f"may still run.*remove '{tmp_path}/.out.lock' and '{partial}'"):
        DestinationLock(out).acquire()
    assert _tree(tmp_path) == before


def _symlink(lock: Path, victim: Path) -> None:
    lock.symlink_to(victim)


def _fifo(lock: Path, _victim: Path) -> None:
    os.mkfifo(lock)


@pytest.mark.parametrize(("what", "make", "words"), [
    ("a symlink to a file", _symlink, "is a symlink"),
    ("a user's file", lambda lock, _v: lock.write_text("mine"), "holds no rl-refit owner record"),
    ("an old pid-only lock", lambda lock, _v: lock.write_text("12345"), "holds no rl-refit owner record"),
    ("an empty file", lambda lock, _v: lock.touch(), "holds no rl-refit owner record"),
    ("a directory", lambda lock, _v: (lock.mkdir(), (lock / "data").write_text("mine")), "is a directory"),
    ("a FIFO", _fifo, "is a FIFO"),
])
def test_what_rl_refit_did_not_create_is_never_touched(what: str, make: object, words: str, mode: str,
                                                      tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / ".out.partial-mine").mkdir()  # a name like a partial's, but no lock names it
    make(tmp_path / ".out.lock", victim)  # type: ignore[operator]
    before = _tree(tmp_path)
    with pytest.raises(ForeignLockFile, match=f"'{tmp_path}/.out.lock' {words}: it is no lock rl-refit made"):
        DestinationLock(tmp_path / "out").acquire()
    assert _tree(tmp_path) == before, what


def test_a_takeover_never_removes_a_protected_directory(tmp_path: Path) -> None:
    out = tmp_path / "out"
    dead = attrs.evolve(Owner.current(), pid=_dead_pid())
    model = _leave(out, dead)  # the model happens to sit where the dead export's partial was
    with DestinationLock(out, protected=[model / "sub" / ".."]):
        assert (model / "model.safetensors").read_bytes() == b"half"


def test_only_what_it_made_is_released_and_removed(tmp_path: Path) -> None:
    lock = DestinationLock(tmp_path / "out")
    lock.acquire()
    partial = lock.create_partial()
    partial.rmdir()
    partial.mkdir()  # someone else's directory now
    lock.remove_partial()
    assert partial.is_dir()
    lock.path.unlink()
    lock.path.write_text("theirs")  # the lock file replaced behind our back
    lock.release()
    assert lock.path.read_text() == "theirs"


@pytest.mark.parametrize("data", [b"not json", b"[1]", b'{"pid": 1}', b"\xff",
                                  b'{"marker": "rl-refit export lock", "pid": 0, "host": "", "boot_id": "", '
                                  b'"pid_namespace": "", "start": null, "token": "00000000000000000000000000000000"}',
                                  b'{"marker": "rl-refit export lock", "pid": 5, "host": "", "boot_id": "", '
                                  b'"pid_namespace": "", "start": null, "token": "../../home"}'])
def test_a_record_is_parsed_strictly(data: bytes) -> None:
    assert Owner.parse(data) is None
    me = Owner.current()
    assert Owner.parse(me.to_bytes()) == me
