"""The safetensors reader of the export: the tensors it reads are safetensors' own, bit for bit;
a file that changes after its header was read is SourceChanged, never a crash; what is no regular
file is refused without blocking."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapters.hf_checkpoint.safetensors_file import SafetensorsFile
from domain.errors import CheckpointError, SourceChanged


@pytest.fixture()
def shard(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "f32": torch.randn(7, generator=g),
        "fp8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
        "i64": torch.arange(6).reshape(2, 3),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path / "model.safetensors"


def test_every_tensor_reads_as_safetensors_reads_it(shard: Path) -> None:
    expected = load_file(shard)
    source = SafetensorsFile(shard)
    assert set(source.tensors) == set(expected)
    for name, tensor in expected.items():
        got = source.read(name)
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)), name
        assert got.data_ptr() % 16 == 0  # its own aligned buffer, not a view into the file
    source.close()


@pytest.mark.parametrize(("change", "words"), [
    (lambda f: os.truncate(f, f.stat().st_size // 2), "its size went from"),
    (lambda f: f.write_bytes(f.read_bytes() + b"more"), "its size went from"),
    (lambda f: os.utime(f, ns=(1, 1)), "it was modified"),
    (lambda f: (f.unlink(), f.write_bytes(b"other")), "it was replaced by another file"),
    (lambda f: f.unlink(), "it cannot be found any more"),
])
def test_a_file_changed_after_its_header_was_read_is_source_changed(change: object, words: str, shard: Path) -> None:
    source = SafetensorsFile(shard)
    source.read("f32")  # opened: later reads use this descriptor
    change(shard)  # type: ignore[operator]
    with pytest.raises(SourceChanged, match=f"model.safetensors: the model's file changed while it was read \\({words}"):
        source.check_unchanged()
    source.close()


def test_a_truncation_while_reading_is_source_changed_not_sigbus(shard: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = SafetensorsFile(shard)
    last = max(source.tensors, key=lambda n: source.tensors[n].offset + source.tensors[n].nbytes)
    source.read("bf16")
    os.truncate(shard, source.tensors[last].offset)  # then the size check itself is fooled:
    monkeypatch.setattr(source, "_check", lambda st: None)
    with pytest.raises(SourceChanged, match=f"it ends before tensor '{last}' does"):
        source.read(last)
    source.close()


def test_a_dtype_export_does_not_read_is_named(tmp_path: Path) -> None:
    save_file({"ids": torch.zeros(4, dtype=torch.int32).view(torch.uint32)}, tmp_path / "u.safetensors")
    with pytest.raises(CheckpointError, match="tensor 'ids' has safetensors dtype U32, which export does not read"):
        SafetensorsFile(tmp_path / "u.safetensors")


def test_what_is_no_regular_file_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo.safetensors")
    with pytest.raises(CheckpointError, match=r"cannot be read \(is a FIFO, not a regular file\); the model.s weight files must be regular"):
        SafetensorsFile(tmp_path / "fifo.safetensors")
