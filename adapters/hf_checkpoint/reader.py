"""Read a Hugging Face safetensors checkpoint directory one tensor at a time.

Only headers are read up front (and checked: a truncated or corrupt file, an index that names
files outside the directory or tensors that are not there, a tensor in two files, all end in
CheckpointError naming the file); each tensor is read with
ordinary reads when the stream reaches it (`adapters.hf_checkpoint.safetensors_file`: never
memory-mapped, so a file truncated meanwhile is `SourceChanged`, not a SIGBUS). Every weight
file is compared with its snapshot before each read and by `check_unchanged`.

Modules the checkpoint already stores quantized (a re-export of an export) are shown in the
*logical* view as the dense weight they decode to (`domain.quant.stored`), so that a plan
decides them like any weight; the *raw* view is the files' tensors as they are.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from adapters.hf_checkpoint.safetensors_file import SafetensorsFile
from adapters.system.files import read_regular
from domain.errors import CheckpointError, QuantizedSource
from domain.quant import naming
from domain.quant.plan import QuantizationPlan
from domain.quant.stored import StoredModule, decode, find_stored
from domain.quant.stream import quantize_stream

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
_FLOAT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _order_key(name: str) -> tuple[int, int, tuple[object, ...]]:
    layer = naming.layer_index(name)
    if layer is not None:
        return (1, layer, naming.natural_key(name))
    before = "embed" in name or "wte" in name
    return (0 if before else 2, 0, naming.natural_key(name))


def _read_json(file: Path, what: str) -> Any:
    try:
        return json.loads(read_regular(file).decode("utf-8"))
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{file}: {what} is not UTF-8 text (byte {err.start}); repair or remove it") from None
    except RecursionError:
        raise CheckpointError(f"{file}: {what} is nested too deeply; repair or remove it") from None
    except ValueError as err:
        raise CheckpointError(f"{file}: {what} is not valid JSON ({str(err).split(';')[0]}); repair or remove it") from None
    except OSError as err:
        raise CheckpointError(f"{file}: {what} cannot be read ({err.strerror or err})") from None


class HfCheckpoint:
    """A checkpoint directory: config.json plus one or more .safetensors files.

    Args:
        path: the directory.
        on_read: optional callback(nbytes) after each source tensor is read (progress bars).
    """

    def __init__(self, path: str | Path, on_read: Callable[[int], None] | None = None) -> None:
        self.path = Path(path)
        self.on_read = on_read
        if not self.path.exists():
            raise CheckpointError(f"model directory {str(self.path)!r} does not exist; pass --model DIR")
        if not self.path.is_dir():
            raise CheckpointError(f"--model {str(self.path)!r} is not a directory; pass the checkpoint directory")
        self._files = self._weight_files()
        self._sources: dict[Path, SafetensorsFile] = {}
        self._entries: dict[str, tuple[Path, torch.dtype, tuple[int, ...]]] = {}
        for file in self._files:
            self._read_header(file)
        self._check_index()
        self._order = sorted(self._entries, key=_order_key)
        self.stored: dict[str, StoredModule] = find_stored(self.tensor_specs(raw=True))
        self._stored_by_weight = {s.weight: s for s in self.stored.values() if s.format is not None}
        hidden = {t for s in self._stored_by_weight.values() for t in s.tensors}
        logical = [n for n in self._order if n not in hidden] + list(self._stored_by_weight)
        self._logical = sorted(logical, key=_order_key)

    # --- headers -----------------------------------------------------------------------------

    def _weight_files(self) -> list[Path]:
        index = self.path / INDEX_NAME
        self._weight_map: dict[str, str] | None = None
        if os.path.lexists(index):  # whatever it is: a FIFO or a broken link is an error, not "no index"
            self._weight_map = self._read_index(index)
            return sorted({self.path / f for f in self._weight_map.values()})
        files = sorted(self.path.glob("*.safetensors"))  # each must be a regular file (checked as it is read)
        if not files:
            raise CheckpointError(
                f"no .safetensors files in {str(self.path)!r}; export needs a safetensors checkpoint "
                "(convert .bin weights with save_pretrained(safe_serialization=True))"
            )
        return files

    def _read_index(self, index: Path) -> dict[str, str]:
        data = _read_json(index, "the safetensors index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: not a safetensors index (no 'weight_map' object of tensor -> file); "
                                  "repair or remove it")
        for name, file in weight_map.items():
            parts = PurePosixPath(file).parts if isinstance(file, str) else ()
            if not parts or parts[0] == "/" or ".." in parts or "\\" in file or not file.endswith(".safetensors"):
                raise CheckpointError(
                    f"{index}: tensor {name!r} maps to {file!r}, which is not a .safetensors file inside the "
                    "model directory; an index names files by their path relative to it"
                )
            if not (self.path / file).is_file():
                raise CheckpointError(f"{index}: tensor {name!r} is in {file!r}, which is not in {str(self.path)!r}")
        return weight_map

    def _read_header(self, file: Path) -> None:
        source = SafetensorsFile(file)
        self._sources[file] = source
        for name, info in source.tensors.items():
            if name in self._entries:
                raise CheckpointError(
                    f"tensor {name!r} is in both {self._entries[name][0].name} and {file.name}; "
                    "a checkpoint holds each tensor once"
                )
            self._entries[name] = (file, info.dtype, info.shape)

    def _check_index(self) -> None:
        if self._weight_map is None:
            return
        missing = sorted(n for n, f in self._weight_map.items()
                         if n not in self._entries or self._entries[n][0] != self.path / f)
        if missing:
            raise CheckpointError(f"{self.path / INDEX_NAME}: {len(missing)} tensor(s) are not in the file the "
                                  f"index names, e.g. {missing[:3]}; repair or remove the index")

    @property
    def config(self) -> dict[str, Any]:
        """The parsed config.json (an empty dict when the directory has none)."""
        file = self.path / CONFIG_NAME
        if not self.has_config:
            return {}
        data = _read_json(file, CONFIG_NAME)
        if not isinstance(data, dict):
            raise CheckpointError(f"{file}: holds a JSON {type(data).__name__}; config.json must be an object")
        return data

    @property
    def has_config(self) -> bool:
        return os.path.lexists(self.path / CONFIG_NAME)  # reading one that is no regular file is an error

    @functools.cached_property
    def logical_dtype(self) -> torch.dtype:
        """The dtype decoded weights take when the plan keeps them: the config's `torch_dtype`
        (bfloat16 when it names none)."""
        config = self.config
        text = config.get("torch_dtype") or config.get("dtype")
        if text is None and isinstance(config.get("text_config"), dict):
            text = config["text_config"].get("torch_dtype") or config["text_config"].get("dtype")
        return _FLOAT_DTYPES.get(str(text).removeprefix("torch."), torch.bfloat16)

    @property
    def total_bytes(self) -> int:
        """Bytes of every tensor in the checkpoint."""
        return sum(torch.Size(s).numel() * d.itemsize for _, d, s in self._entries.values())

    def source_files(self) -> list[Path]:
        """The weight files the checkpoint reads (and its index)."""
        index = [self.path / INDEX_NAME] if self._weight_map is not None else []
        return [*self._files, *index]

    def decoded_formats(self) -> dict[str, int]:
        """Preset -> number of modules stored in it that the logical view decodes."""
        counts: dict[str, int] = {}
        for s in self._stored_by_weight.values():
            counts[s.format.name] = counts.get(s.format.name, 0) + 1  # type: ignore[union-attr]
        return counts

    def check_decodable(self) -> None:
        """Raise QuantizedSource when a stored-quantized module matches no preset's layout."""
        bad = [s for s in self.stored.values() if s.format is None]
        if bad:
            more = f" (and {len(bad) - 1} more modules)" if len(bad) > 1 else ""
            raise QuantizedSource(
                f"module {bad[0].module!r} is stored quantized as {bad[0].found}{more}, which is no FP8_BLOCK, "
                "MXFP8, MXFP4 or NVFP4 layout that rl-refit decodes; export from the BF16 checkpoint (only a "
                "configuration that passes this checkpoint through untouched can keep these tensors)"
            )

    def tensor_specs(self, raw: bool = False) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """Every tensor's name, shape and dtype, in layer order (headers only).

        Args:
            raw: the files' tensors as stored; False: stored-quantized modules as the dense
                weight they decode to (in `logical_dtype`).
        """
        specs = []
        for n in self._order if raw else self._logical:
            stored = None if raw else self._stored_by_weight.get(n)
            specs.append((n, stored.shape, self.logical_dtype) if stored else (n, self._entries[n][2], self._entries[n][1]))
        return specs

    def tensor_shapes(self, raw: bool = False) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor's name and shape, in layer order (headers only); `raw` as in tensor_specs."""
        return [(n, s) for n, s, _ in self.tensor_specs(raw)]

    # --- tensors -----------------------------------------------------------------------------

    def iter_tensors(self, raw: bool = False, plan: QuantizationPlan | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) in layer order, reading one tensor at a time.

        Args:
            raw: the files' tensors; False: the logical view (stored-quantized modules decoded).
            plan: the plan the tensors are for: a decoded weight it quantizes is yielded in
                float32 (the exact decoded values), one it keeps in `logical_dtype`.
        """
        try:
            for name in self._order if raw else self._logical:
                stored = None if raw else self._stored_by_weight.get(name)
                if stored is None:
                    yield name, self._read(name)
                    continue
                quantized = plan is not None and plan.decide(name, stored.shape).is_quantized
                tensors = {t: self._read(t) for t in stored.tensors}
                yield name, decode(stored, tensors, torch.float32 if quantized else self.logical_dtype)
        finally:
            for source in self._sources.values():
                source.close()

    def _read(self, name: str) -> torch.Tensor:
        tensor = self._sources[self._entries[name][0]].read(name)
        if self.on_read is not None:
            self.on_read(tensor.numel() * tensor.element_size())
        return tensor

    def check_unchanged(self) -> None:
        """Raise SourceChanged when a weight file is no longer what it was when its header was read
        (replaced, another size or modification time)."""
        for source in self._sources.values():
            source.check_unchanged()

    def export(self, plan: QuantizationPlan) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the quantized checkpoint tensors in layer order (quantize_stream over iter_tensors)."""
        return quantize_stream(plan, self.iter_tensors(plan=plan))


def local_model_config(path: str | None) -> dict[str, Any] | None:
    """The config.json of a local model directory, or None when `path` is unset, is not a local
    directory (a hub id, a missing path) or holds no config.json.

    Args:
        path: model.path.

    Returns:
        The parsed config.json. Raises CheckpointError when it exists but cannot be read.
    """
    if not path or not Path(path).is_dir():
        return None
    file = Path(path) / CONFIG_NAME
    if not os.path.lexists(file):
        return None
    data = _read_json(file, CONFIG_NAME)
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: holds a JSON {type(data).__name__}; config.json must be an object")
    return data
