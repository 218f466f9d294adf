"""What `refit export` does to `--out` and to what sits beside it: it never deletes or replaces
what it did not check (a directory or file that appears meanwhile, the model, a user's files named
like a lock or a partial, another running export's lock and partial), one export holds a
destination at a time, `--force` never replaces the current or home directory, and an output that
cannot be written is one line with nothing left behind.

The output paths are fuzzed in test_export_output_paths.py, kills and races in
test_export_crash.py, the lock itself in tests/unit/test_ownership.py.
"""

from __future__ import annotations

import builtins
import errno
import os
from pathlib import Path
from typing import Any

import pytest

from adapters.hf_checkpoint import writer as writer_module
from adapters.system.ownership import DestinationLock
from app.cli.main import main
from app.services import checkpoint_export
from domain.errors import ConfigError
from tests.integration.export_models import one_line, tiny_checkpoint, tree

EXPORT = ["rollout.quantization.linear=NVFP4", "rollout.quantization.moe=MXFP4"]
FP8_EXPORT = ["rollout.quantization.linear=FP8_BLOCK"]


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("src") / "model")


# --- what appears in --out while the export runs -------------------------------------------------


def test_a_directory_created_in_out_while_exporting_survives(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    real_close = writer_module.CheckpointWriter.close

    def close_while_someone_writes(self: Any) -> None:
        (out / "theirs").mkdir(parents=True)
        (out / "theirs" / "data.bin").write_bytes(b"precious")
        real_close(self)

    monkeypatch.setattr(writer_module.CheckpointWriter, "close", close_while_someone_writes)
    assert main(["export", "--model", str(src), "--out", str(out), *EXPORT]) == 2
    assert "OutputChanged" in capsys.readouterr().err
    assert (out / "theirs" / "data.bin").read_bytes() == b"precious"  # before: deleted, exit 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_empty_out_that_gains_content_is_not_replaced(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    out.mkdir()
    real_close = writer_module.CheckpointWriter.close

    def close_while_someone_writes(self: Any) -> None:
        (out / "late.txt").write_text("mine")
        real_close(self)

    monkeypatch.setattr(writer_module.CheckpointWriter, "close", close_while_someone_writes)
    assert main(["export", "--model", str(src), "--out", str(out), *EXPORT]) == 2
    assert "OutputChanged" in capsys.readouterr().err and (out / "late.txt").read_text() == "mine"


def test_a_second_export_to_the_same_out_is_refused_while_the_first_runs(src: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    with DestinationLock(out):  # what the first export holds while it runs
        assert main(["export", "--model", str(src), "--out", str(out), *EXPORT]) == 2
    assert "OutputBusy" in capsys.readouterr().err and not out.exists()
    assert main(["export", "--model", str(src), "--out", str(out), *EXPORT]) == 0  # the lock died with its holder


def test_out_dot_in_an_empty_directory(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "here"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["export", "--model", str(src), "--out", ".", *EXPORT]) == 0
    assert (tmp_path / "here" / "config.json").is_file()


# --- the source model named like a partial ----------------------------------------------------


def test_a_model_named_like_a_partial_directory_is_never_deleted(src: Path, tmp_path: Path) -> None:
    model = tiny_checkpoint(tmp_path / ".o.partial-1")
    before = tree(model)
    assert main(["export", "--model", str(model), "--out", str(tmp_path / "o"), *FP8_EXPORT]) == 0  # before: exit 2
    assert tree(model) == before  # before: deleted by the clean-up of "stale partials"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".o.partial-1", "o"]


# --- an empty --out (an unset shell variable), the current and home directories ---------------------


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("value", ["", " ", "\t\n"])
def test_an_empty_or_blank_out_or_model_is_refused(value: str, force: bool, src: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)
    before = tree(tmp_path)
    flags = ["--force"] if force else []
    assert main(["export", "--model", str(src), "--out", value, *flags, *FP8_EXPORT]) == 2  # before: exit 0, cwd replaced
    one_line(capsys, "ConfigError: --out:", "empty or blank")
    assert main(["export", "--model", value, "--out", str(tmp_path / "o"), *flags, *FP8_EXPORT]) == 2
    one_line(capsys, "ConfigError: --model:", "empty or blank")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("out", [".", "..", "home", "home/.."])
def test_force_never_replaces_the_current_or_home_directory_or_one_holding_them(
        out: str, src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    home = tmp_path / "home"
    (home / "user").mkdir(parents=True)
    (home / "user" / "notes.txt").write_text("mine")
    monkeypatch.setattr(checkpoint_export, "_home", lambda: home / "user", raising=False)  # before: no such seam
    monkeypatch.chdir(home / "user")
    before = tree(tmp_path)
    target = {"home": str(home / "user"), "home/..": str(home)}.get(out, out)
    assert main(["export", "--model", str(src), "--out", target, "--force", *FP8_EXPORT]) == 2
    one_line(capsys, "OutputProtected", "which --force never replaces")
    assert tree(tmp_path) == before


def test_a_relative_out_in_a_removed_working_directory_is_a_config_error(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(ConfigError, match="the current directory, which no longer exists"):  # before: FileNotFoundError
        checkpoint_export.destination("o")
    assert checkpoint_export.destination(tmp_path / "o") == tmp_path / "o"
    assert all(name != "the current directory" for name, _ in checkpoint_export._protected())


# --- what sits where the lock or a partial goes ------------------------------------------------


def test_a_lock_that_is_a_symlink_is_never_followed(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    victim = tmp_path / "FILE"
    victim.write_text("precious")
    (tmp_path / ".o.lock").symlink_to(victim)
    assert main(["export", "--model", str(src), "--out", str(tmp_path / "o"), *FP8_EXPORT]) == 2
    one_line(capsys, "ForeignLockFile", ".o.lock' is a symlink")
    assert victim.read_text() == "precious"  # before: overwritten with the export's pid, exit 0
    assert (tmp_path / ".o.lock").is_symlink() and not (tmp_path / "o").exists()


def test_user_files_named_like_partials_survive_an_export(src: Path, tmp_path: Path) -> None:
    (tmp_path / ".o.partial-x").mkdir()
    (tmp_path / ".o.partial-x" / "data").write_text("mine")
    (tmp_path / ".o.partial-1").write_text("mine")
    (tmp_path / ".o.lock.bak").write_text("mine")
    before = tree(tmp_path)
    assert main(["export", "--model", str(src), "--out", str(tmp_path / "o"), *FP8_EXPORT]) == 0
    after = tree(tmp_path)
    assert {k: v for k, v in after.items() if k != "o" and not k.startswith("o/")} == before  # before: deleted


def test_a_user_file_named_like_the_lock_is_refused_and_kept(src: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    (tmp_path / ".o.lock").write_text("mine")
    assert main(["export", "--model", str(src), "--out", str(tmp_path / "o"), *FP8_EXPORT]) == 2  # before: deleted, exit 0
    one_line(capsys, "ForeignLockFile", "holds no rl-refit owner record", "move it away")
    assert (tmp_path / ".o.lock").read_text() == "mine" and not (tmp_path / "o").exists()


def test_an_export_leaves_another_running_exports_lock_and_partial_alone(src: Path, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Export B writes to D/a.partial-x; export A to D/a starts and ends while B runs."""
    real_close = writer_module.CheckpointWriter.close
    seen: dict[str, Any] = {}

    def close(self: Any) -> None:
        if self.directory.name.startswith(".a.partial-x.") and "a" not in seen:  # B, mid-export: A runs now
            seen["a"] = main(["export", "--model", str(src), "--out", str(tmp_path / "a"), *FP8_EXPORT])
            seen["b's lock"] = (tmp_path / ".a.partial-x.lock").is_file()
            seen["b's partial"] = (self.directory / "model.safetensors").is_file()
        real_close(self)

    monkeypatch.setattr(writer_module.CheckpointWriter, "close", close)
    assert main(["export", "--model", str(src), "--out", str(tmp_path / "a.partial-x"), *FP8_EXPORT]) == 0  # before: 2
    assert seen == {"a": 0, "b's lock": True, "b's partial": True}  # before: A removed both
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "a.partial-x"]


# --- an output that cannot be written -------------------------------------------------------------


@pytest.mark.parametrize(("code", "fix"), [(errno.EROFS, "read-only"), (errno.EACCES, "no permission"),
                                          (errno.ENOSPC, "free some space")])
def test_an_output_that_cannot_be_written(code: int, fix: str, src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture) -> None:
    def refuse(*_a: Any, **_k: Any) -> Any:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(writer_module, "open", refuse, raising=False)
    assert main(["export", "--model", str(src), "--out", str(tmp_path / "out"), *EXPORT]) == 2
    err = capsys.readouterr().err
    assert "OutputNotWritable" in err and fix in err and os.strerror(code) in err
    assert list(tmp_path.iterdir()) == []


def test_builtins_open_is_untouched() -> None:
    assert writer_module.__dict__.get("open", builtins.open) is builtins.open  # the patches above were undone


def test_an_out_below_a_symlink_loop_is_a_one_line_error(src: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    assert main(["export", "--model", str(src), "--out", str(tmp_path / "loop" / "o"), *FP8_EXPORT]) == 2  # before: 3
    one_line(capsys, "OutputNotWritable", f"{tmp_path / 'loop'}'", "choose another --out")
