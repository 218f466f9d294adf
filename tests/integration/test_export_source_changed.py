"""A source that changes while `refit export` reads it (truncated, or rewritten in place) ends the
export in one SourceChanged line, exit 2, with nothing published and no lock or partial left
behind. The reader's own checks are in tests/unit/test_safetensors_file.py.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from adapters.hf_checkpoint import writer as writer_module
from app.cli.main import main
from tests.integration import export_child
from tests.integration.export_models import one_line, tiny_checkpoint

EXPORT = ["rollout.quantization.linear=FP8_BLOCK"]


def test_a_source_truncated_during_the_export_is_source_changed(tmp_path: Path) -> None:
    model = tiny_checkpoint(tmp_path / "m")
    out, err = tmp_path / "o", tmp_path / "stderr"
    with export_child.forkserver() as ctx:
        child = ctx.Process(target=export_child.run_export_truncating,
                            args=(["--model", str(model), "--out", str(out), *EXPORT],
                                  str(model / "model.safetensors"), str(err)))
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
    one_line(capsys, "SourceChanged", "it was modified", "nothing was published")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
