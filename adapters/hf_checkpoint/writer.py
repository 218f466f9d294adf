"""Write a sharded safetensors checkpoint while the tensors stream in.

Every output tensor's name, dtype and shape is known before any is computed
(`domain.quant.stream.checkpoint_specs`), so each shard's header is written first and each tensor's
bytes go straight to their offset as they arrive: memory holds one tensor, never a shard.
The files are standard safetensors (8-byte header length, JSON header padded to 8 bytes,
contiguous data) plus a `model.safetensors.index.json`. Until `close` has checked that every
declared tensor arrived, a shard's header length reads 0, so a shard cut short by a crash never
parses as a checkpoint (its tensors would be zeros); `close` writes the length and fsyncs.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import torch

from domain.errors import CheckpointError, OutputNotWritable, RefitError
from domain.quant.stream import TensorSpec

INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 2**30  # what save_pretrained uses

_CODES = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.uint8: "U8", torch.int8: "I8",
    torch.int16: "I16", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL",
}


_FIXES = {errno.ENOSPC: "free some space or choose another --out",
          errno.EROFS: "the file system is read-only; choose another --out",
          errno.EACCES: "no permission; choose another --out", errno.EPERM: "no permission; choose another --out",
          errno.EDQUOT: "the disk quota is exceeded; free some space or choose another --out",
          errno.EEXIST: "a file is in the way; move it, or choose another --out",
          errno.ENOTDIR: "a part of the path is a file, not a directory; choose another --out",
          errno.ELOOP: "the path runs into a symlink loop; choose another --out"}


@contextlib.contextmanager
def writing(what: str | Path) -> Iterator[None]:
    """Turn an OSError while writing `what` into OutputNotWritable, with the fix for its errno.

    Args:
        what: the file or directory being written, for the message.
    """
    try:
        yield
    except OSError as err:
        if isinstance(err, RefitError):  # already explained (OutputBusy, OutputNotWritable, ...)
            raise
        fix = _FIXES.get(err.errno or 0, "check the destination and try again")
        raise OutputNotWritable(f"cannot write {str(what)!r}: {err.strerror or err}; {fix}") from err


def fsync_file(path: Path) -> None:
    """Flush a written file's data to the device (a rename publishes only what is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Write a small file and fsync it."""
    with writing(path), open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _shards(specs: Sequence[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def _header(specs: Sequence[TensorSpec]) -> tuple[bytes, dict[str, int]]:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offsets: dict[str, int] = {}
    pos = 0
    for spec in specs:
        if spec.dtype not in _CODES:
            raise CheckpointError(f"tensor {spec.name!r}: dtype {spec.dtype} cannot be written to safetensors")
        header[spec.name] = {"dtype": _CODES[spec.dtype], "shape": list(spec.shape), "data_offsets": [pos, pos + spec.nbytes]}
        offsets[spec.name] = pos
        pos += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return raw, offsets


class CheckpointWriter:
    """Streams tensors into pre-declared safetensors shards in `directory`.

    Args:
        directory: an existing, empty directory.
        specs: every tensor that will be written, in the order they are laid out.
        max_shard_bytes: shard size bound (a tensor larger than it gets a shard of its own).
    """

    def __init__(self, directory: str | Path, specs: Sequence[TensorSpec], max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        self.directory = Path(directory)
        shards = _shards(specs, max_shard_bytes)
        self._files: list[BinaryIO] = []
        self._where: dict[str, tuple[int, int, TensorSpec]] = {}
        self._written: set[str] = set()
        self.weight_map: dict[str, str] = {}
        self.total_bytes = sum(s.nbytes for s in specs)
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise CheckpointError(f"tensor names {dup[:5]} appear twice in the checkpoint being written")
        self._header_bytes: list[int] = []
        try:
            for i, shard in enumerate(shards):
                fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                head, offsets = _header(shard)
                with writing(self.directory / fname):
                    f = open(self.directory / fname, "wb")  # noqa: SIM115 - closed in close()
                    self._files.append(f)
                    f.write(struct.pack("<Q", 0) + head)  # length 0 until close: not a checkpoint yet
                    f.truncate(8 + len(head) + sum(s.nbytes for s in shard))
                self._header_bytes.append(len(head))
                for spec in shard:
                    self._where[spec.name] = (i, 8 + len(head) + offsets[spec.name], spec)
                    self.weight_map[spec.name] = fname
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write one declared tensor's bytes at its offset.

        Args:
            name: its checkpoint name.
            tensor: the tensor; dtype and shape must match the declaration.
        """
        if name not in self._where:
            raise CheckpointError(f"tensor {name!r} was not declared for this checkpoint")
        if name in self._written:
            raise CheckpointError(f"tensor {name!r} was written twice")
        i, offset, spec = self._where[name]
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise CheckpointError(
                f"tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, declared {spec.dtype} {spec.shape}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        f = self._files[i]
        with writing(f.name):
            f.seek(offset)
            f.write(data.data)
        self._written.add(name)

    def close(self) -> None:
        """Check every declared tensor arrived, write the shard headers' lengths, fsync and close
        the shards, and write the index."""
        missing = sorted(set(self._where) - self._written)
        if missing:
            self.abort()
            raise CheckpointError(f"{len(missing)} declared tensor(s) never arrived, e.g. {missing[:5]}")
        for f, head in zip(self._files, self._header_bytes, strict=True):
            with writing(f.name):
                f.seek(0)
                f.write(struct.pack("<Q", head))
                f.flush()
                os.fsync(f.fileno())
                f.close()
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(self.weight_map.items()))}
        write_durably(self.directory / INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode())

    def abort(self) -> None:
        """Close the shard files without checking (the caller removes the directory)."""
        for f in self._files:
            if not f.closed:
                f.close()
