"""The captured-storage fingerprint and its check after a refit, and the digest that says two
tensors hold the same weights.

Storage captured by CUDA graphs is never rebound: after a refit every captured tensor has the same
data pointer, shape, stride and dtype (ARCHITECTURE.md section 6).
"""

from __future__ import annotations

import hashlib

import attrs
import torch


@attrs.frozen
class StorageRecord:
    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> StorageRecord:
        return cls(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


@attrs.frozen
class StorageFingerprint:
    """The identity of every captured live tensor, by name."""

    records: dict[str, StorageRecord]

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> StorageFingerprint:
        return cls({name: StorageRecord.of(t) for name, t in tensors.items()})

    def differences(self, after: StorageFingerprint) -> list[str]:
        """Names whose pointer, shape, stride or dtype changed, or that appeared or vanished."""
        names = sorted(set(self.records) | set(after.records))
        return [n for n in names if self.records.get(n) != after.records.get(n)]

    def to_plain(self) -> list[list[object]]:
        """Lists of ints and strings, for a boundary that carries no Python objects (msgpack, JSON)."""
        return [[n, r.data_ptr, list(r.shape), list(r.stride), str(r.dtype).removeprefix("torch.")]
                for n, r in self.records.items()]

    @classmethod
    def from_plain(cls, rows: list[list[object]]) -> StorageFingerprint:
        """The inverse of `to_plain`."""
        return cls({
            str(n): StorageRecord(int(p), tuple(shape), tuple(stride), getattr(torch, str(dtype)))  # type: ignore[arg-type,call-overload]
            for n, p, shape, stride, dtype in rows
        })


@attrs.frozen
class StorageCheck:
    """The captured-storage check after a refit.

    Attributes:
        checked: False when the refit failed before the check could run.
        changed: names whose data pointer, shape, stride or dtype changed.
    """

    checked: bool
    changed: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.checked and not self.changed

    def __str__(self) -> str:
        if not self.checked:
            return "not run"
        return "ok" if not self.changed else f"REBOUND ({len(self.changed)})"


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes (what "the same weights" means, bit for bit)."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# The digest of a weight an engine keeps in a form it cannot read back: vLLM's CPU build packs BF16
# Linear weights into oneDNN handles and leaves `layer.weight` an empty tensor. Two such digests
# are not "the same bytes": a comparison lists them as not compared (their computation is checked
# by the log-probs and greedy tokens instead).
UNREADABLE = "unreadable (packed by the engine)"


def weight_digest(t: torch.Tensor) -> str:
    """`tensor_digest`, or UNREADABLE for an emptied tensor whose values the engine keeps elsewhere."""
    return UNREADABLE if t.numel() == 0 else tensor_digest(t)

