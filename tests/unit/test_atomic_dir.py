"""Publishing a directory: it replaces only what was checked, with renameat2 and without it (the
destination lock is tested in test_ownership.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapters.system import atomic_dir
from adapters.system.atomic_dir import DirState, publish
from domain.errors import OutputChanged


@pytest.fixture(params=["renameat2", "plain renames"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "renameat2" and atomic_dir._RENAMEAT2 is None:
        pytest.skip("this libc has no renameat2")
    if request.param == "plain renames":
        monkeypatch.setattr(atomic_dir, "_RENAMEAT2", None)
    return request.param


def _new(tmp: Path) -> Path:
    new = tmp / ".out.partial-1"
    new.mkdir()
    (new / "config.json").write_text("new")
    return new


def _files(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): p.read_text() for p in path.rglob("*") if p.is_file()}


def test_publish_into_an_absent_destination(mode: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    publish(_new(tmp_path), out, DirState.of(out))
    assert _files(out) == {"config.json": "new"} and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_destination_created_meanwhile_is_left_alone(mode: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    checked = DirState.of(out)
    new = _new(tmp_path)
    out.mkdir()  # someone else, after the check: not even an empty directory is replaced
    with pytest.raises(OutputChanged, match="created by someone else"):
        publish(new, out, checked)
    assert list(out.iterdir()) == []
    (out / "theirs.txt").write_text("theirs")
    with pytest.raises(OutputChanged):
        publish(new, out, checked)
    assert _files(out) == {"theirs.txt": "theirs"} and _files(new) == {"config.json": "new"}


def test_replace_what_was_checked(mode: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "sub" / "old.txt").write_text("old")
    publish(_new(tmp_path), out, DirState.of(out))
    assert _files(out) == {"config.json": "new"} and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("change", ["add", "modify", "remove", "replace"])
def test_a_destination_changed_meanwhile_is_restored(mode: str, change: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.txt").write_text("a")
    checked = DirState.of(out)
    if change == "add":
        (out / "b.txt").write_text("b")
    elif change == "modify":
        (out / "a.txt").write_text("aa")
    elif change == "remove":
        (out / "a.txt").unlink()
    else:  # the directory itself replaced by another with the same content
        (out / "a.txt").unlink()
        out.rmdir()
        out.mkdir()
        (out / "a.txt").write_text("a")
    expected = _files(out)
    new = _new(tmp_path)
    with pytest.raises(OutputChanged, match="changed while the export ran"):
        publish(new, out, checked)
    assert _files(out) == expected and _files(new) == {"config.json": "new"}
