"""One safetensors file, read with ordinary reads and checked against a snapshot of itself.

The header is parsed and checked here as safetensors checks it (an 8-byte little-endian length,
then a JSON object of tensor -> dtype, shape and data_offsets; the tensors contiguous, filling the
file), and each tensor is read with `os.preadv` into a fresh buffer. No page of the file is ever
memory-mapped: a file that another process truncates while it is read cannot kill the reader with
SIGBUS, the read comes back short instead. The file's identity, size and modification time are
taken when the header is read and compared again before every tensor and by `check_unchanged`;
any difference, or a short read, is `SourceChanged`.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from pathlib import Path

import attrs
import torch

from adapters.system.files import open_regular
from domain.errors import CheckpointError, SourceChanged

MAX_HEADER_BYTES = 100_000_000  # safetensors' own bound
DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8, "I8": torch.int8,
    "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
    "F8_E8M0": getattr(torch, "float8_e8m0fnu", torch.uint8),
}
_UNREAD_DTYPES = frozenset({"U16", "U32", "U64", "F4", "F6_E2M3", "F6_E3M2", "C64"})  # valid safetensors, not read


@attrs.frozen
class Snapshot:
    """What a file was when its header was read."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> Snapshot:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def difference(self, now: Snapshot) -> str | None:
        """How `now` differs from this snapshot, in words; None when it does not."""
        if (now.device, now.inode) != (self.device, self.inode):
            return "it was replaced by another file"
        if now.size != self.size:
            return f"its size went from {self.size} to {now.size} bytes"
        if now.mtime_ns != self.mtime_ns:
            return "it was modified"
        return None


@attrs.frozen
class TensorInfo:
    """Where one tensor's bytes are: `nbytes` from byte `offset` of the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class SafetensorsFile:
    """A safetensors file: its header (read at once) and its tensors (read on demand).

    Args:
        path: the file (symlinks are followed; it must be a regular file).

    Raises CheckpointError naming the file when it cannot be read or is not safetensors.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        fd = self._open()
        try:
            st = os.fstat(fd)
            self.snapshot = Snapshot.of(st)
            self.tensors = _parse(fd, st.st_size, path)
        finally:
            os.close(fd)

    def _open(self) -> int:
        try:
            return open_regular(self.path)
        except OSError as err:
            raise CheckpointError(f"{self.path}: cannot be read ({err.strerror or err}); the model's weight files "
                                  "must be regular files") from None

    def read(self, name: str) -> torch.Tensor:
        """One tensor, read from the file now (its bytes in a new buffer).

        Args:
            name: a tensor of `tensors`.

        Returns:
            The tensor. Raises SourceChanged when the file is no longer what its snapshot says.
        """
        info = self.tensors[name]
        if self._fd is None:
            self._fd = self._open()
        self._check(os.fstat(self._fd))
        buffer = torch.empty(info.nbytes, dtype=torch.uint8)
        view = buffer.numpy().data  # a writable memoryview of the tensor
        done = 0
        while done < info.nbytes:
            try:
                n = os.preadv(self._fd, [view[done:]], info.offset + done)
            except OSError as err:
                raise CheckpointError(f"{self.path}: tensor {name!r} cannot be read ({err.strerror or err})") from None
            if n == 0:
                raise self._changed(f"it ends before tensor {name!r} does")
            done += n
        return buffer.view(info.dtype).reshape(info.shape)

    def check_unchanged(self) -> None:
        """Raise SourceChanged when the file at `path` is no longer the one the header was read from,
        or its size or modification time changed."""
        try:
            st = os.stat(self.path)
        except OSError as err:
            raise self._changed(f"it cannot be found any more ({err.strerror or err})") from None
        self._check(st)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _check(self, st: os.stat_result) -> None:
        what = self.snapshot.difference(Snapshot.of(st))
        if what is not None:
            raise self._changed(what)

    def _changed(self, what: str) -> SourceChanged:
        return SourceChanged(f"{self.path}: the model's file changed while it was read ({what}); nothing was "
                             "published: wait until whatever writes the model has finished, then export again")


def _read_exactly(fd: int, n: int, offset: int) -> bytes | None:
    data = os.pread(fd, n, offset)
    return data if len(data) == n else None


def _parse(fd: int, size: int, path: Path) -> dict[str, TensorInfo]:
    """The header's tensors, checked as safetensors checks them (the file is `size` bytes)."""

    def bad(reason: str) -> CheckpointError:
        return CheckpointError(f"{path}: not a readable safetensors file ({reason}); re-download or re-save it")

    head = _read_exactly(fd, 8, 0) if size >= 8 else None
    if head is None:
        raise bad(f"{size} bytes, shorter than the 8-byte header length")
    (length,) = struct.unpack("<Q", head)
    if length > MAX_HEADER_BYTES:
        raise bad(f"header length {length} is over safetensors' bound of {MAX_HEADER_BYTES} bytes")
    raw = _read_exactly(fd, length, 8) if 8 + length <= size else None
    if raw is None:
        raise bad(f"header length {length} runs past the end of the {size}-byte file")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise bad(f"the header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise bad(f"the header is a JSON {type(header).__name__}, not an object")
    data_start = 8 + length
    tensors = {name: _tensor(name, entry, data_start, bad) for name, entry in header.items() if name != "__metadata__"}
    end = data_start
    for name, info in sorted(tensors.items(), key=lambda item: item[1].offset):
        if info.offset != end:
            raise bad(f"tensor {name!r} does not start where the tensor before it ends")
        end += info.nbytes
    if end != size:
        raise bad(f"its tensors end at byte {end}, the file at byte {size}")
    return tensors


def _tensor(name: str, entry: object, data_start: int, bad: Callable[[str], CheckpointError]) -> TensorInfo:
    def fail(problem: str) -> CheckpointError:
        return bad(f"tensor {name!r} {problem}")

    if not isinstance(entry, dict):
        raise fail("is not described by a JSON object")
    code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise fail(f"has no valid shape ({shape!r})")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise fail(f"has no valid data_offsets ({offsets!r})")
    if not isinstance(code, str) or code not in DTYPES:
        if isinstance(code, str) and code in _UNREAD_DTYPES:
            raise CheckpointError(f"tensor {name!r} has safetensors dtype {code}, which export does not read")
        raise fail(f"has an unknown dtype ({code!r})")
    dtype = DTYPES[code]
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes != offsets[1] - offsets[0]:
        raise fail(f"spans {offsets[1] - offsets[0]} bytes, but its dtype and shape need {nbytes}")
    return TensorInfo(dtype, tuple(shape), data_start + offsets[0], nbytes)
