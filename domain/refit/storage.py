"""The captured-storage fingerprint and its check after a refit, and the digest that says two
tensors hold the same weights.

Storage captured by CUDA graphs is never rebound: after a refit every captured tensor has the same
data pointer, shape, stride and dtype (docs/refit.md#what-one-refit-does).
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
    """A hex digest of a tensor's dtype, shape and bytes (what "the same weights" means, bit for bit),
    computed where the tensor lives: no host copy of it is made.

    On the host it is sha256 over the bytes. On a GPU the bytes are folded on the device into a
    128-bit fingerprint (`_device_fingerprint`), and only those 16 bytes cross to the host; the
    sha256 then covers dtype, shape and the fingerprint. Digests therefore compare tensors on the
    same kind of device (an engine's weights against a cold start of the same engine).
    """
    t = t.detach()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    if not t.numel():
        return h.hexdigest()
    if t.device.type == "cpu":
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
    h.update(f"fold128@{t.device.type}|".encode())
    h.update(_device_fingerprint(t).cpu().numpy().tobytes())
    return h.hexdigest()


# The digest of a weight an engine keeps in a form it cannot read back: vLLM's CPU build packs BF16
# Linear weights into oneDNN handles and leaves `layer.weight` an empty tensor. Two such digests
# are not "the same bytes": a comparison lists them as not compared (their computation is checked
# by the log-probs and greedy tokens instead).
UNREADABLE = "unreadable (packed by the engine)"


def weight_digest(t: torch.Tensor) -> str:
    """`tensor_digest`, or UNREADABLE for an emptied tensor whose values the engine keeps elsewhere."""
    return UNREADABLE if t.numel() == 0 else tensor_digest(t)


@attrs.frozen
class DigestComparison:
    """Two sets of weight digests by name, compared: an UNREADABLE digest equals nothing, not even
    another UNREADABLE one, so such a name is listed as not compared instead of counted as equal.

    Attributes:
        compared: names readable on both sides, whose digests were compared.
        differing: names compared whose digests differ, and names present on one side only.
        unreadable: names present on both sides and UNREADABLE on either: not compared.
    """

    compared: tuple[str, ...]
    differing: tuple[str, ...]
    unreadable: tuple[str, ...]

    @classmethod
    def of(cls, before: dict[str, str], after: dict[str, str], skip: frozenset[str] = frozenset()) -> DigestComparison:
        """Compare `before` with `after`, leaving out the names in `skip`.

        Args:
            before: digests by name (`weight_digest`).
            after: digests by name.
            skip: names not to compare at all (e.g. a cold start's placeholders).

        Returns:
            The comparison, each tuple sorted.
        """
        names = sorted((set(before) | set(after)) - skip)
        both = [n for n in names if n in before and n in after]
        unreadable = tuple(n for n in both if UNREADABLE in (before[n], after[n]))
        packed = set(unreadable)
        compared = tuple(n for n in both if n not in packed)
        differing = tuple(n for n in names if n not in before or n not in after
                          or (n not in packed and before[n] != after[n]))
        return cls(compared, differing, unreadable)

    @property
    def same(self) -> bool | None:
        """True when every compared digest is equal (and no name is on one side only); None when
        nothing could be compared."""
        if self.differing:
            return False
        return True if self.compared else None


# odd 64-bit constants (splitmix64's and xorshift*'s multipliers, as signed int64)
_K1, _K2, _K3, _K4 = -7046029254386353131, -4658895280553007687, -7723592293110705685, 0x2545F4914F6CDD1D
_FOLD_WORDS = 1 << 22  # 32 MiB of int64 temporaries per step on the device


def _device_fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two int64 lanes folding every byte of `t` where it lives: each 8-byte word is mixed with its
    index (so order counts), and the mixed words are summed (wrapping) in two independent ways.
    The tail of fewer than 8 bytes is folded as one zero-padded word. Memory: one step's
    temporaries (`_FOLD_WORDS` words), never a copy of the tensor (unless it is not contiguous)."""
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    n = raw.numel() // 8
    lanes = torch.zeros(2, dtype=torch.int64, device=t.device)
    words = raw[: n * 8].view(torch.int64)
    for start in range(0, n, _FOLD_WORDS):
        _fold(lanes, words[start : start + _FOLD_WORDS], start)
    if raw.numel() > n * 8:
        tail = torch.zeros(8, dtype=torch.uint8, device=t.device)
        tail[: raw.numel() - n * 8] = raw[n * 8 :]
        _fold(lanes, tail.view(torch.int64), n)
    return lanes


def _fold(lanes: torch.Tensor, words: torch.Tensor, start: int) -> None:
    index = torch.arange(start, start + words.numel(), dtype=torch.int64, device=words.device)
    x = (words ^ (index * _K1)) * _K2
    x = (x ^ (x >> 31)) * _K3
    lanes[0] += x.sum()
    lanes[1] += ((x ^ (x >> 29)) * _K4).sum()
