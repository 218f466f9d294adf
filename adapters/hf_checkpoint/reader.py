"""Read a Hugging Face safetensors checkpoint directory one tensor at a time.

Implements the WeightExporter port. Only headers are read up front; each tensor is read with
`safetensors.safe_open` when the stream reaches it, from a handle that is reopened regularly so
that the memory-mapped pages already consumed are released.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

try:
    from safetensors import safe_open
except ModuleNotFoundError as err:  # pragma: no cover
    raise ModuleNotFoundError("HfCheckpoint needs the safetensors package", name="safetensors") from err

from domain.errors import CheckpointError
from domain.quant import naming
from domain.quant.plan import QuantizationPlan
from domain.quant.stream import quantize_stream

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
_REOPEN_BYTES = 64 * 2**20  # reopen a file's handle after this many bytes were read from it


def _order_key(name: str) -> tuple[int, int, tuple[object, ...]]:
    layer = naming.layer_index(name)
    if layer is not None:
        return (1, layer, naming.natural_key(name))
    before = "embed" in name or "wte" in name
    return (0 if before else 2, 0, naming.natural_key(name))


class HfCheckpoint:
    """A checkpoint directory: config.json plus one or more .safetensors files.

    Args:
        path: the directory.
        on_read: optional callback(nbytes) after each source tensor is read (progress bars).
    """

    def __init__(self, path: str | Path, on_read: Callable[[int], None] | None = None) -> None:
        self.path = Path(path)
        self.on_read = on_read
        if not self.path.is_dir():
            raise CheckpointError(f"model directory {str(self.path)!r} does not exist; pass --model DIR")
        self._files = self._weight_files()
        self._entries: dict[str, tuple[Path, torch.dtype, tuple[int, ...]]] = {}
        for file in self._files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                    sl = f.get_slice(name)
                    self._entries[name] = (file, _dtype(sl.get_dtype(), name), tuple(sl.get_shape()))
        self._order = sorted(self._entries, key=_order_key)

    def _weight_files(self) -> list[Path]:
        index = self.path / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as err:
                raise CheckpointError(f"{index}: not a safetensors index ({err}); repair or remove it") from None
            return sorted({self.path / f for f in weight_map.values()})
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"no .safetensors files in {str(self.path)!r}; export needs a safetensors checkpoint "
                "(convert .bin weights with save_pretrained(safe_serialization=True))"
            )
        return files

    @property
    def config(self) -> dict[str, Any]:
        """The parsed config.json (an empty dict when the directory has none)."""
        file = self.path / CONFIG_NAME
        if not file.is_file():
            return {}
        try:
            return json.loads(file.read_text())
        except ValueError as err:
            raise CheckpointError(f"{file}: not valid JSON ({err})") from None

    @property
    def total_bytes(self) -> int:
        """Bytes of every tensor in the checkpoint."""
        return sum(torch.Size(s).numel() * d.itemsize for _, d, s in self._entries.values())

    def tensor_specs(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """Every tensor's name, shape and dtype, in layer order (headers only)."""
        return [(n, self._entries[n][2], self._entries[n][1]) for n in self._order]

    def tensor_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor's name and shape, in layer order (headers only)."""
        return [(n, self._entries[n][2]) for n in self._order]

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) in layer order, reading one tensor at a time."""
        handles: dict[Path, tuple[Any, Any, int]] = {}
        try:
            for name in self._order:
                file = self._entries[name][0]
                ctx, handle, consumed = handles.get(file, (None, None, _REOPEN_BYTES))
                if consumed >= _REOPEN_BYTES:
                    if ctx is not None:
                        ctx.__exit__(None, None, None)
                    ctx = safe_open(str(file), framework="pt")
                    handle, consumed = ctx.__enter__(), 0
                tensor = handle.get_tensor(name)
                nbytes = tensor.numel() * tensor.element_size()
                handles[file] = (ctx, handle, consumed + nbytes)
                if self.on_read is not None:
                    self.on_read(nbytes)
                yield name, tensor
                del tensor
        finally:
            for ctx, _, _ in handles.values():
                ctx.__exit__(None, None, None)

    def export(self, plan: QuantizationPlan) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the quantized checkpoint tensors in layer order (the WeightExporter port)."""
        return quantize_stream(plan, self.iter_tensors())


_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8, "I8": torch.int8,
    "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
    "F8_E8M0": getattr(torch, "float8_e8m0fnu", torch.uint8),
}


def _dtype(code: str, name: str) -> torch.dtype:
    try:
        return _DTYPES[code]
    except KeyError:
        raise CheckpointError(f"tensor {name!r} has safetensors dtype {code}, which export does not read") from None
