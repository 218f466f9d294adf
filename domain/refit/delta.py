"""Delta records: one checkpoint-format tensor sent as the elements that changed since a base.

A delta compares two tensors of one shape and dtype element by element on their stored bits (the
integer view of the element size): FP8 codes as their bytes, packed FP4 as bytes (two codes per
byte), E8M0 scales as uint8, FP32 and BF16 scales as their int32/int16 views. Comparing bits, not
values, makes a patch bit-exact (a NaN equals itself, -0.0 differs from 0.0).

The changed elements are named by the smallest of three run-length index codings: a bitmap (one bit
per element), the runs of changed elements ((start, length) pairs of int32, or int64 beyond 2**31
elements: clustered changes), or the runs of unchanged elements before each change as uint8 or
uint16 tokens (scattered changes: a token v > 0 skips v - 1 elements and names the next one, a 0
skips 255 or 65535 elements; about one byte per change at the 2% of a BF16 step, two bytes at the
0.2% of an FP8 one). A record is
one flat uint8 tensor (a 64-byte header, the index, the new elements' bytes), so it travels through
the buckets and transports unchanged, under the tensor's name plus DELTA_SUFFIX.

Each record carries the digest of its base and of the tensor it patches into. The digest is a
SHA-256 of dtype, shape and bytes, truncated to 16 bytes: hashlib is in the standard library, runs on
the CPU's SHA extensions (faster here than BLAKE2b), and 128 bits make a matching digest mean the
same bytes. A checksum (CRC) is faster but too short to vouch for a whole model's copy.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Mapping

import attrs
import torch

from domain.errors import DeltaBaseMismatch, DeltaRecordError

# Reserved name suffixes: never part of a checkpoint name ('@' does not occur in module paths).
DELTA_SUFFIX = "@delta"  # the tensor is a delta record against the receiver's copy
UNKEPT_SUFFIX = "@unkept"  # the tensor is whole and the receiver must not keep a copy of it

MAGIC = b"RLD1"
HEADER = struct.Struct("<4sBBxxQQQ16s16s")  # magic, coding, itemsize, numel, count, runs, digests
HEADER_BYTES = 64
DIGEST_BYTES = 16
_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


class Coding(enum.IntEnum):
    """How a record names its changed elements."""

    BITMAP = 0
    RUNS32 = 1
    RUNS64 = 2
    GAPS8 = 3
    GAPS16 = 4


_GAP_TOKEN = {Coding.GAPS8: (torch.uint8, 255), Coding.GAPS16: (torch.int16, 65535)}


def checkpoint_name(sent: str) -> tuple[str, bool]:
    """The checkpoint name of a tensor as sent, and whether it is a delta record."""
    if sent.endswith(DELTA_SUFFIX):
        return sent.removesuffix(DELTA_SUFFIX), True
    return sent.removesuffix(UNKEPT_SUFFIX), False


def tensor_digest(t: torch.Tensor) -> bytes:
    """16 bytes of SHA-256 over a tensor's dtype, shape and bytes.

    Args:
        t: any tensor (moved to the host and made contiguous when it is not).

    Returns:
        The digest.
    """
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.digest()[:DIGEST_BYTES]


def state_digest(digests: Mapping[str, bytes]) -> str | None:
    """One digest (hex) of a whole copy, from its tensors' digests; None for an empty copy."""
    if not digests:
        return None
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(name.encode() + b"\0" + digests[name])
    return h.hexdigest()[:32]


def int_view(t: torch.Tensor) -> torch.Tensor | None:
    """A flat integer view of a contiguous tensor's elements (None for an element size with none)."""
    view = _INT_VIEWS.get(t.element_size())
    return t.reshape(-1).view(view) if view is not None else None


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    pad = (-mask.numel()) % 8
    m = torch.cat([mask, mask.new_zeros(pad)]) if pad else mask
    return (m.view(-1, 8).to(torch.uint8) * _BITS).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    return ((packed.unsqueeze(1) & _BITS) != 0).reshape(-1)[:numel]


def _runs(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, lengths) of the consecutive stretches of a sorted index."""
    if index.numel() == 0:
        return index, index
    brk = torch.ones_like(index, dtype=torch.bool)
    brk[1:] = index[1:] != index[:-1] + 1
    at = brk.nonzero().reshape(-1)
    lengths = torch.diff(at, append=torch.tensor([index.numel()]))
    return index[at], lengths


def _gap_tokens(index: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(skip tokens per change, the token of each change) of a sorted index (see the module doc)."""
    gaps = torch.diff(index, prepend=torch.tensor([-1])) - 1  # unchanged elements before each change
    return gaps // top, gaps % top + 1


def _encode_gaps(index: torch.Tensor, coding: Coding) -> torch.Tensor:
    dtype, top = _GAP_TOKEN[coding]
    skips, last = _gap_tokens(index, top)
    at = torch.cumsum(skips + 1, 0) - 1  # where each change's token goes; skip tokens (0) before it
    tokens = torch.zeros(int(at[-1]) + 1 if at.numel() else 0, dtype=torch.int64)
    tokens[at] = last
    return tokens.to(torch.int32).to(dtype).view(torch.uint8)  # 65535 wraps to int16 -1: read back as uint16


def _decode_gaps(coded: torch.Tensor, coding: Coding) -> torch.Tensor:
    dtype, top = _GAP_TOKEN[coding]
    tokens = coded.view(dtype).to(torch.int64)
    if dtype == torch.int16:
        tokens = tokens & 0xFFFF
    advance = torch.where(tokens == 0, top, tokens)
    return (torch.cumsum(advance, 0) - 1)[tokens != 0]


def _from_runs(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    count = int(lengths.sum())
    first = torch.repeat_interleave(starts, lengths)
    offsets = torch.arange(count) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    return first + offsets


@attrs.frozen(eq=False)
class DeltaRecord:
    """The changed elements of one tensor, with the digests of its base and of its result.

    Attributes:
        coding: how `index` names the changed elements.
        numel: elements of the tensor.
        itemsize: bytes per element.
        count: changed elements.
        runs: stretches of consecutive changed elements (RUNS codings), tokens (GAPS codings), 0
            for a bitmap.
        base_digest: `tensor_digest` of the tensor the record applies to.
        new_digest: `tensor_digest` of the tensor it patches into.
        index: the index coding's bytes (uint8).
        values: the changed elements' new bytes, in index order (uint8).
    """

    coding: Coding
    numel: int
    itemsize: int
    count: int
    runs: int
    base_digest: bytes
    new_digest: bytes
    index: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes of the record as sent."""
        return HEADER_BYTES + _pad8(self.index.numel()) + self.values.numel()

    def to_tensor(self) -> torch.Tensor:
        """The record as one flat uint8 tensor (header, index padded to 8 bytes, values)."""
        out = torch.zeros(self.nbytes, dtype=torch.uint8)
        head = HEADER.pack(MAGIC, int(self.coding), self.itemsize, self.numel, self.count, self.runs,
                           self.base_digest, self.new_digest)
        out[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        at = HEADER_BYTES
        out[at: at + self.index.numel()] = self.index
        at += _pad8(self.index.numel())
        out[at:] = self.values
        return out

    @classmethod
    def from_tensor(cls, name: str, record: torch.Tensor) -> DeltaRecord:
        """Parse a record sent for tensor `name` (views of `record`, no copy).

        Raises:
            DeltaRecordError: naming the tensor, when the bytes are not a whole record.
        """
        if record.dtype != torch.uint8 or record.dim() != 1 or record.numel() < HEADER_BYTES:
            raise DeltaRecordError(f"delta record of {name!r}: expected a flat uint8 tensor of at least "
                                   f"{HEADER_BYTES} bytes, got {record.dtype} {tuple(record.shape)}")
        magic, coding, itemsize, numel, count, runs, base, new = HEADER.unpack(
            record[: HEADER.size].cpu().numpy().tobytes())
        if magic != MAGIC or coding not in Coding._value2member_map_ or itemsize not in _INT_VIEWS:
            raise DeltaRecordError(f"delta record of {name!r}: bad header (magic {magic!r}, coding {coding}, "
                                   f"itemsize {itemsize}); sender and receiver versions differ")
        c = Coding(coding)
        index_bytes = _index_bytes(c, numel, runs)
        expected = HEADER_BYTES + _pad8(index_bytes) + count * itemsize
        if record.numel() != expected:
            raise DeltaRecordError(f"delta record of {name!r}: {record.numel()} bytes, its header says {expected}")
        at = HEADER_BYTES + _pad8(index_bytes)
        return cls(c, numel, itemsize, count, runs, base, new, record[HEADER_BYTES: HEADER_BYTES + index_bytes],
                   record[at:])

    def mask_or_index(self) -> torch.Tensor:
        """The changed elements: a bool mask (bitmap) or an int64 index (runs)."""
        if self.coding is Coding.BITMAP:
            return _unpack_bits(self.index, self.numel)
        if self.coding in _GAP_TOKEN:
            return _decode_gaps(self.index, self.coding)
        pairs = self.index.view(torch.int32 if self.coding is Coding.RUNS32 else torch.int64).to(torch.int64)
        return _from_runs(pairs[: self.runs], pairs[self.runs:])


def _index_bytes(coding: Coding, numel: int, runs: int) -> int:
    if coding is Coding.BITMAP:
        return -(-numel // 8)
    if coding in _GAP_TOKEN:
        return runs * (1 if coding is Coding.GAPS8 else 2)
    return runs * 2 * (4 if coding is Coding.RUNS32 else 8)


def diff(base: torch.Tensor, new: torch.Tensor, *, base_digest: bytes, new_digest: bytes) -> DeltaRecord | None:
    """The delta from `base` to `new`, or None when sending `new` whole is no larger.

    Args:
        base: the receiver's copy (host, contiguous); same shape and dtype as `new`.
        new: the tensor to send (host, contiguous).
        base_digest: `tensor_digest(base)`.
        new_digest: `tensor_digest(new)`.

    Returns:
        The record with the smaller index coding, or None.
    """
    whole = nbytes(new)
    b, n = int_view(base), int_view(new)
    if b is None or n is None or base.shape != new.shape or base.dtype != new.dtype or whole <= HEADER_BYTES:
        return None
    mask = torch.ne(b, n)
    count = int(torch.count_nonzero(mask))
    values_bytes = count * new.element_size()
    if HEADER_BYTES + values_bytes >= whole:
        return None
    numel = n.numel()
    index = mask.nonzero().reshape(-1)
    del mask  # every size below comes from the unchanged runs before each change (one pass each)
    gaps = torch.diff(index, prepend=index.new_tensor([-1])) - 1
    wide = numel > 2**31 - 1
    runs_coding = Coding.RUNS64 if wide else Coding.RUNS32
    runs_count = int(torch.count_nonzero(gaps[1:])) + 1 if count else 0
    sizes = {Coding.BITMAP: _index_bytes(Coding.BITMAP, numel, 0),
             runs_coding: _index_bytes(runs_coding, numel, runs_count)}
    for gaps_coding, (_, top) in _GAP_TOKEN.items():
        sizes[gaps_coding] = _index_bytes(gaps_coding, numel, count + int(torch.div(gaps, top, rounding_mode="floor").sum()))
    del gaps
    coding = min(sizes, key=lambda c: (sizes[c], c))
    if coding is runs_coding:
        starts, lengths = _runs(index)
        coded = torch.cat([starts, lengths]).to(torch.int64 if wide else torch.int32).view(torch.uint8)
        runs = starts.numel()
    elif coding in _GAP_TOKEN:
        coded = _encode_gaps(index, coding)
        runs = coded.numel() // (1 if coding is Coding.GAPS8 else 2)
    else:
        flags = torch.zeros(numel, dtype=torch.bool)
        flags[index] = True
        coded, runs = _pack_bits(flags), 0
    record = DeltaRecord(coding, numel, new.element_size(), count, runs, base_digest, new_digest, coded,
                         n[index].view(torch.uint8))
    return record if record.nbytes < whole else None


def patch_(name: str, base: torch.Tensor, record: DeltaRecord, base_digest: bytes) -> bytes:
    """Patch `base` in place into the record's tensor; returns the new digest.

    Args:
        name: the tensor's checkpoint name (for errors).
        base: the receiver's copy (host, contiguous), overwritten.
        record: the delta.
        base_digest: the digest the receiver holds for `base`.

    Raises:
        DeltaBaseMismatch: the record was made against another base, does not fit `base`, or the
            patched bytes are not the sender's (the copy was corrupted); `base` is then undefined.
    """
    if record.base_digest != base_digest:
        raise DeltaBaseMismatch(
            f"tensor {name!r}: the delta applies to base {record.base_digest.hex()}, the receiver holds "
            f"{base_digest.hex()}; the delta is refused and the refit is sent whole")
    view = int_view(base)
    if view is None or view.numel() != record.numel or base.element_size() != record.itemsize:
        raise DeltaBaseMismatch(f"tensor {name!r}: a delta of {record.numel} x {record.itemsize}-byte elements "
                                f"does not fit the receiver's {base.dtype} {tuple(base.shape)} copy")
    if record.count:
        view[record.mask_or_index()] = record.values.view(view.dtype)
    got = tensor_digest(base)
    if got != record.new_digest:
        raise DeltaBaseMismatch(
            f"tensor {name!r}: the patched copy hashes to {got.hex()}, the sender's tensor to "
            f"{record.new_digest.hex()}: the receiver's base copy was corrupted; the delta is refused and the refit is sent whole")
    return got


def apply(name: str, base: torch.Tensor, record: DeltaRecord) -> torch.Tensor:
    """The record's tensor, from a base left untouched (checks as `patch_`)."""
    out = base.detach().cpu().contiguous().clone()
    patch_(name, out, record, tensor_digest(base))
    return out
