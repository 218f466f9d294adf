"""Issue 27, "never delete what is not ours": each reproduction of the hostile-user probe, as it was
found, with the behaviour that replaces it (the output paths are fuzzed in
test_export_output_paths.py, the lock itself in tests/unit/test_ownership.py).

Before: the stale-partial clean-up removed every `.NAME.partial-*` and `.NAME.lock`-like entry
beside --out by its name (the model, a user's files, another running export's), the lock file
was opened through symlinks, `--out ""` meant the current directory, and a source truncated while
it was memory-mapped killed the export with SIGBUS.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from adapters.hf_checkpoint import writer as writer_module
from app.cli.main import main
from app.services import checkpoint_export
from domain.errors import ConfigError
from tests.integration import export_child
from tests.integration.export_models import tiny_checkpoint

EXPORT = ["rollout.quantization.linear=FP8_BLOCK"]


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("src") / "model")


def _tree(path: Path) -> dict[str, bytes | str]:
    """Every entry under `path` (symlinks by target, directories as "/"), with file bytes."""
    out: dict[str, bytes | str] = {}
    for p in sorted(path.rglob("*")):
        out[str(p.relative_to(path))] = os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else "/"
    return out


def _one_line(capsys: pytest.CaptureFixture, *words: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    for w in words:
        assert w in err[0], (w, err[0])
    return err[0]


# --- 1: the source model named like a partial ----------------------------------------------------


def test_a_model_named_like_a_partial_directory_is_never_deleted(src: Path, tmp_path: Path) -> None:
    model = tiny_checkpoint(tmp_path / ".o.partial-1")
    before = _tree(model)
    assert main(["export", "--model", str(model), "--out", str(tmp_path / "o"), *EXPORT]) == 0  # before: exit 2
    assert _tree(model) == before  # before: deleted by the clean-up of "stale partials"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".o.partial-1", "o"]


# --- 2: an empty --out (an unset shell variable) --------------------------------------------------


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("value", ["", " ", "\t\n"])
def test_an_empty_or_blank_out_or_model_is_refused(value: str, force: bool, src: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)
    before = _tree(tmp_path)
    flags = ["--force"] if force else []
    assert main(["export", "--model", str(src), "--out", value, *flags, *EXPORT]) == 2  # before: exit 0, cwd replaced
    _one_line(capsys, "ConfigError: --out:", "empty or blank")
    assert main(["export", "--model", value, "--out", str(tmp_path / "o"), *flags, *EXPORT]) == 2
    _one_line(capsys, "ConfigError: --model:", "empty or blank")
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("out", [".", "..", "home", "home/.."])
def test_force_never_replaces_the_current_or_home_directory_or_one_holding_them(
        out: str, src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    home = tmp_path / "home"
    (home / "user").mkdir(parents=True)
    (home / "user" / "notes.txt").write_text("mine")
    monkeypatch.setattr(checkpoint_export, "_home", lambda: home / "user", raising=False)  # before: no such seam
    monkeypatch.chdir(home / "user")
    before = _tree(tmp_path)
    target = {"home": str(home / "user"), "home/..": str(home)}.get(out, out)
    assert main(["export", "--model", str(src), "--out", target, "--force", *EXPORT]) == 2
    _one_line(capsys, "OutputProtected", "which --force never replaces")
    assert _tree(tmp_path) == before


# --- 3 and 4: what sits where the lock or a partial goes ------------------------------------------


def test_a_lock_that_is_a_symlink_is_never_followed(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    victim = tmp_path / "FILE"
    victim.write_text("precious")
    (tmp_path / ".o.lock").symlink_to(victim)
    assert main(["export", "--model", str(src), "--out", str(tmp_path / "o"), *EXPORT]) == 2
    _one_line(capsys, "ForeignLockFile", ".o.lock' is a symlink")
    assert victim.read_text() == "precious"  # before: overwritten with the export's pid, exit 0
    assert (tmp_path / ".o.lock").is_symlink() and not (tmp_path / "o").exists()


def test_user_files_named_like_partials_survive_an_export(src: Path, tmp_path: Path) -> None:
    (tmp_path / ".o.partial-x").mkdir()
    (tmp_path / ".o.partial-x" / "data").write_text("mine")
    (tmp_path / ".o.partial-1").write_text("mine")
    (tmp_path / ".o.lock.bak").write_text("mine")
    before = _tree(tmp_path)
    assert main(["export", "--model", str(src), "--out", str(tmp_path / "o"), *EXPORT]) == 0
    after = _tree(tmp_path)
    assert {k: v for k, v in after.items() if k != "o" and not k.startswith("o/")} == before  # before: deleted


def test_a_user_file_named_like_the_lock_is_refused_and_kept(src: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    (tmp_path / ".o.lock").write_text("mine")
    assert main(["export", "--model", str(src), "--out", str(tmp_path / "o"), *EXPORT]) == 2  # before: deleted, exit 0
    _one_line(capsys, "ForeignLockFile", "holds no rl-refit owner record", "move it away")
    assert (tmp_path / ".o.lock").read_text() == "mine" and not (tmp_path / "o").exists()


# --- 5: two exports side by side ------------------------------------------------------------------


def test_an_export_leaves_another_running_exports_lock_and_partial_alone(src: Path, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Export B writes to D/a.partial-x; export A to D/a starts and ends while B runs."""
    real_close = writer_module.CheckpointWriter.close
    seen: dict[str, Any] = {}

    def close(self: Any) -> None:
        if self.directory.name.startswith(".a.partial-x.") and "a" not in seen:  # B, mid-export: A runs now
            seen["a"] = main(["export", "--model", str(src), "--out", str(tmp_path / "a"), *EXPORT])
            seen["b's lock"] = (tmp_path / ".a.partial-x.lock").is_file()
            seen["b's partial"] = (self.directory / "model.safetensors").is_file()
        real_close(self)

    monkeypatch.setattr(writer_module.CheckpointWriter, "close", close)
    assert main(["export", "--model", str(src), "--out", str(tmp_path / "a.partial-x"), *EXPORT]) == 0  # before: 2
    assert seen == {"a": 0, "b's lock": True, "b's partial": True}  # before: A removed both
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "a.partial-x"]


# --- 6: the source changes while it is read -------------------------------------------------------


def test_a_source_truncated_during_the_export_is_source_changed(src: Path, tmp_path: Path) -> None:
    model = tiny_checkpoint(tmp_path / "m")
    out, err = tmp_path / "o", tmp_path / "stderr"
    ctx: Any = export_child.context()
    child = ctx.Process(target=export_child.run_export_truncating,
                        args=(["--model", str(model), "--out", str(out), *EXPORT], str(model / "model.safetensors"),
                              str(err)))
    child.start()
    child.join(300)
    assert child.exitcode == 2, (child.exitcode, -signal.SIGBUS)  # before: killed by SIGBUS, no message
    line = err.read_text().strip()
    assert "SourceChanged" in line and "model.safetensors" in line and line.count("\n") == 0, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "stderr"]  # before: the lock and the partial stayed


def test_a_source_rewritten_in_place_during_the_export_is_source_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture) -> None:
    model = tiny_checkpoint(tmp_path / "m")
    shard = model / "model.safetensors"
    real_close = writer_module.CheckpointWriter.close

    def close_while_the_model_is_rewritten(self: Any) -> None:
        data = shard.read_bytes()
        shard.write_bytes(data)  # same size, same bytes, a new modification time: it is not what was read
        os.utime(shard, ns=(1, 1))
        real_close(self)

    monkeypatch.setattr(writer_module.CheckpointWriter, "close", close_while_the_model_is_rewritten)
    assert main(["export", "--model", str(model), "--out", str(tmp_path / "o"), *EXPORT]) == 2  # before: exit 0
    _one_line(capsys, "SourceChanged", "it was modified", "nothing was published")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


# --- input files that are no regular files; symlink loops -----------------------------------------


def _fifo_environment(t: Path, fifo: Path, s: Path) -> list[str]:
    return ["doctor", "--environment", str(fifo)]


def _fifo_config(t: Path, fifo: Path, s: Path) -> list[str]:
    return ["plan", str(fifo)]


def _fifo_config_file(t: Path, fifo: Path, s: Path) -> list[str]:
    return ["plan", f"rollout.quantization.config_file={fifo}"]


def _fifo_model_config(t: Path, fifo: Path, s: Path) -> list[str]:
    model = tiny_checkpoint(t / "m")
    (model / "config.json").unlink()
    (model / "config.json").symlink_to(fifo)  # a FIFO where the config should be
    return ["export", "--model", str(model), "--out", str(t / "o"), *EXPORT]


@pytest.mark.parametrize(("make", "words"), [
    (_fifo_environment, ("ConfigError: --environment", "is a FIFO, not a regular file")),
    (_fifo_config, ("ConfigError: CONFIG", "not a regular file")),
    (_fifo_config_file, ("ConfigError: rollout.quantization.config_file", "not a regular file")),
    (_fifo_model_config, ("CheckpointError", "is a FIFO, not a regular file")),
], ids=["doctor --environment", "CONFIG", "config_file", "the model's config.json"])
def test_an_input_file_that_is_a_fifo_is_refused_without_blocking(
        make: Callable[[Path, Path, Path], list[str]], words: tuple[str, ...], src: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    argv = make(tmp_path, fifo, src)
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(main(argv)), daemon=True)
    worker.start()
    worker.join(60)
    if worker.is_alive():  # before (doctor --environment): blocked forever on the open; give it a writer
        with open(fifo, "w"):
            pass
        worker.join(10)
        pytest.fail(f"refit {argv[0]} blocked on the FIFO")
    assert result == [2]
    _one_line(capsys, *words)


def test_a_weight_file_that_is_a_symlink_loop_is_a_one_line_error(src: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    model = tiny_checkpoint(tmp_path / "m")
    (model / "loop.safetensors").symlink_to(model / "loop.safetensors")
    assert main(["export", "--model", str(model), "--out", str(tmp_path / "o"), *EXPORT]) == 2  # before: exit 3
    _one_line(capsys, "CheckpointError", "loop.safetensors", "Too many levels of symbolic links")
    assert main(["plan", "--model", str(model)]) == 2
    _one_line(capsys, "CheckpointError", "loop.safetensors")


def test_an_out_below_a_symlink_loop_is_a_one_line_error(src: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    assert main(["export", "--model", str(src), "--out", str(tmp_path / "loop" / "o"), *EXPORT]) == 2  # before: 3
    _one_line(capsys, "OutputNotWritable", f"{tmp_path / 'loop'}'", "choose another --out")


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
