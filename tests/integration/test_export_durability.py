"""What an export writes survives a crash as a whole or not at all: a shard cut short by a kill
never parses as a checkpoint with zeros for its missing tensors, and every shard and directory is
fsynced before the partial directory is renamed into place. Kills at random points and racing
exports are in test_export_crash.py.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open

from adapters.hf_checkpoint import writer as writer_module
from app.cli.main import main
from tests.integration.export_models import tiny_checkpoint

EXPORT = ["rollout.quantization.linear=NVFP4", "rollout.quantization.moe=MXFP4"]


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("src") / "model")


def test_a_shard_cut_short_does_not_parse(tmp_path: Path) -> None:
    from domain.quant.stream import TensorSpec

    specs = [TensorSpec(f"t{i}", torch.bfloat16, (64, 64)) for i in range(4)]
    w = writer_module.CheckpointWriter(tmp_path, specs)
    w.write("t0", torch.ones(64, 64, dtype=torch.bfloat16))  # killed here: the other tensors are zeros
    w.abort()
    with pytest.raises(SafetensorError), safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        list(f.keys())  # before: it parsed, with t1..t3 all zeros


def test_shards_and_directories_are_fsynced_before_the_rename(src: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else "?")
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    out = tmp_path / "out"
    assert main(["export", "--model", str(src), "--out", str(out), "--shard-size-mb", "0.01", *EXPORT]) == 0
    partial = next(p for p in synced if re.fullmatch(rf"{re.escape(str(tmp_path))}/\.out\.partial-[0-9a-f]{{32}}", p))
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    for name in [*shards, "model.safetensors.index.json", "config.json", "tokenizer_config.json"]:
        assert f"{partial}/{name}" in synced, name
    assert synced.index(partial) > max(synced.index(f"{partial}/{n}") for n in shards)  # the directory after its files
    assert synced[-1] == str(tmp_path)  # the rename itself
