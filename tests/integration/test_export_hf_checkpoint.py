"""The HF checkpoint adapter: streaming reader (layer order, headers only, errors) and the
streaming sharded writer (files safetensors reads back bit for bit, declaration checks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapters.hf_checkpoint.reader import HfCheckpoint
from adapters.hf_checkpoint.writer import CheckpointWriter
from domain.errors import CheckpointError
from domain.quant.plan import QuantizationPlan
from domain.quant.stream import TensorSpec


def _tensors() -> dict[str, torch.Tensor]:
    return {
        "lm_head.weight": torch.randn(16, 8).to(torch.bfloat16),
        "model.embed_tokens.weight": torch.randn(16, 8).to(torch.bfloat16),
        "model.layers.10.mlp.down_proj.weight": torch.randn(8, 32).to(torch.bfloat16),
        "model.layers.2.self_attn.q_proj.weight": torch.randn(32, 32),
        "model.layers.2.input_layernorm.weight": torch.ones(8, dtype=torch.float16),
        "model.norm.weight": torch.ones(8),
        "model.layers.2.scale": torch.tensor([3], dtype=torch.int64),
        "x.f8": torch.randn(4, 4).to(torch.float8_e4m3fn),
        "x.u8": torch.arange(12, dtype=torch.uint8).reshape(3, 4),
    }


def test_reader_streams_in_layer_order_from_sharded_files(tmp_path: Path) -> None:
    t = _tensors()
    names = list(t)
    save_file({k: t[k] for k in names[:4]}, tmp_path / "a.safetensors")
    save_file({k: t[k] for k in names[4:]}, tmp_path / "b.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    reads: list[int] = []
    ckpt = HfCheckpoint(tmp_path, on_read=reads.append)
    order = [n for n, _ in ckpt.tensor_shapes()]
    assert order[0] == "model.embed_tokens.weight"
    assert order.index("model.layers.2.self_attn.q_proj.weight") < order.index("model.layers.10.mlp.down_proj.weight")
    assert order.index("model.layers.10.mlp.down_proj.weight") < order.index("lm_head.weight")
    streamed = dict(ckpt.iter_tensors())
    assert all(torch.equal(streamed[k].view(torch.uint8), t[k].view(torch.uint8)) for k in t)
    assert sum(reads) == ckpt.total_bytes == sum(v.numel() * v.element_size() for v in t.values())
    assert ckpt.config == {"model_type": "qwen3"}
    assert dict(ckpt.export(QuantizationPlan.bf16())).keys() == t.keys()


def test_reader_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        HfCheckpoint(tmp_path / "absent")
    with pytest.raises(CheckpointError, match=r"no \.safetensors files"):
        HfCheckpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="not a safetensors index"):
        HfCheckpoint(tmp_path)


def test_writer_output_reads_back_bit_for_bit(tmp_path: Path) -> None:
    t = _tensors()
    specs = [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in t.items()]
    writer = CheckpointWriter(tmp_path, specs, max_shard_bytes=600)
    for k in reversed(list(t)):  # any arrival order
        writer.write(k, t[k])
    writer.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    back: dict[str, torch.Tensor] = {}
    for s in shards:
        back.update(load_file(tmp_path / s))
    assert back.keys() == t.keys()
    for k, v in t.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k].view(torch.uint8), v.view(torch.uint8))


def test_writer_rejects_undeclared_mismatched_repeated_and_missing(tmp_path: Path) -> None:
    spec = TensorSpec("a", torch.float32, (2, 2))
    writer = CheckpointWriter(tmp_path, [spec, TensorSpec("b", torch.uint8, (3,))])
    with pytest.raises(CheckpointError, match="not declared"):
        writer.write("c", torch.zeros(2, 2))
    with pytest.raises(CheckpointError, match=r"declared torch.float32 \(2, 2\)"):
        writer.write("a", torch.zeros(2, 3))
    writer.write("a", torch.zeros(2, 2))
    with pytest.raises(CheckpointError, match="written twice"):
        writer.write("a", torch.zeros(2, 2))
    with pytest.raises(CheckpointError, match="never arrived"):
        writer.close()
    with pytest.raises(CheckpointError, match="appear twice"):
        CheckpointWriter(tmp_path, [spec, spec])
