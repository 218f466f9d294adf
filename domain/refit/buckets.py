"""Buckets: flat byte buffers that carry (name, tensor) pairs from the trainer to the engine.

The planner packs a stream, in order, into uint8 buffers of at most `bucket_bytes`, every tensor
at an offset aligned to `alignment` bytes. A tensor larger than a bucket travels alone (as a view
of its own bytes, without a copy). The final bucket is always marked last, even when it is empty.
The receiver unpacks a bucket into views of its buffer without copying, and must copy or consume
them before it acknowledges the bucket (returns from `load_bucket`): the sender may reuse the
buffer for the next bucket as soon as it has.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import attrs
import torch

from domain.errors import BucketLayoutError

# 256 bytes: enough for any dtype's view and for the alignment GPU copy engines prefer.
DEFAULT_ALIGNMENT = 256


def align_up(n: int, alignment: int) -> int:
    """The smallest multiple of `alignment` that is >= n."""
    return -(-n // alignment) * alignment


def _non_negative(_inst: object, attr: attrs.Attribute, value: int) -> None:
    if value < 0:
        raise BucketLayoutError(f"{attr.name} must be >= 0, got {value}")


def _shape(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(d) for d in value)


def _metas(value: Iterable[TensorMeta]) -> tuple[TensorMeta, ...]:
    return tuple(value)


def _tensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel * dtype.itemsize


@attrs.frozen
class TensorMeta:
    """Where one tensor lies inside a bucket's flat buffer.

    Attributes:
        name: checkpoint-format tensor name.
        shape: the tensor's shape.
        dtype: the tensor's dtype.
        offset: byte offset of its first byte in the buffer (aligned).
        nbytes: number of bytes it occupies.
    """

    name: str
    shape: tuple[int, ...] = attrs.field(converter=_shape)
    dtype: torch.dtype
    offset: int = attrs.field(validator=_non_negative)
    nbytes: int = attrs.field(validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        if not self.name:
            raise BucketLayoutError("a tensor in a bucket needs a non-empty name")
        expected = _tensor_nbytes(self.shape, self.dtype)
        if self.nbytes != expected:
            raise BucketLayoutError(
                f"tensor {self.name!r}: nbytes {self.nbytes} does not match shape {self.shape} "
                f"of {self.dtype} ({expected} bytes)"
            )
        if self.offset % self.dtype.itemsize:
            raise BucketLayoutError(
                f"tensor {self.name!r}: offset {self.offset} is not a multiple of the "
                f"{self.dtype} element size; use an aligned layout"
            )

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def _tensors(value: Iterable[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(value)


@attrs.frozen(eq=False)
class Bucket:
    """One bucket of a refit.

    A bucket is packed (its tensors' bytes lie in `buffer`, at their offsets: what a transport
    moves) or, for a consumer in the same process, by reference (`tensors` holds the tensors
    themselves, `buffer` is empty, and the offsets say where they would lie once packed).

    Attributes:
        index: position in the refit's bucket sequence, from 0.
        buffer: flat uint8 tensor holding every tensor's bytes at its offset (empty when the
            bucket is by reference).
        metas: the tensors, in stream order.
        is_last: True on the final bucket of a refit (which may be empty).
        retained: the bytes stay valid and unchanged until the refit ends (finalize or abort),
            so a consumer may keep views of them instead of copying (an engine staging by
            reference). False: the buffer may be reused as soon as the consumer returns.
        tensors: by reference: the tensors of `metas`, in order, contiguous (empty when packed).
    """

    index: int = attrs.field(validator=_non_negative)
    buffer: torch.Tensor
    metas: tuple[TensorMeta, ...] = attrs.field(converter=_metas)
    is_last: bool
    retained: bool = False
    tensors: tuple[torch.Tensor, ...] = attrs.field(default=(), converter=_tensors)

    def __attrs_post_init__(self) -> None:
        if self.buffer.dtype != torch.uint8 or self.buffer.dim() != 1:
            raise BucketLayoutError(
                f"bucket {self.index}: buffer must be a flat uint8 tensor, got "
                f"{self.buffer.dtype} of shape {tuple(self.buffer.shape)}"
            )
        end = 0
        for m in self.metas:
            if m.offset < end:
                raise BucketLayoutError(f"bucket {self.index}: tensor {m.name!r} overlaps the one before")
            end = m.end
        if self.tensors:
            if len(self.tensors) != len(self.metas):
                raise BucketLayoutError(
                    f"bucket {self.index}: {len(self.tensors)} tensors by reference for {len(self.metas)} entries"
                )
            for m, t in zip(self.metas, self.tensors, strict=True):
                if tuple(t.shape) != m.shape or t.dtype != m.dtype or not t.is_contiguous():
                    raise BucketLayoutError(
                        f"bucket {self.index}: tensor {m.name!r} by reference is {t.dtype} {tuple(t.shape)} "
                        f"(contiguous: {t.is_contiguous()}), its entry says {m.dtype} {m.shape}"
                    )
        elif end > self.buffer.numel():
            raise BucketLayoutError(
                f"bucket {self.index}: tensors need {end} bytes but the buffer holds {self.buffer.numel()}"
            )

    @property
    def by_reference(self) -> bool:
        """The bucket holds references to its tensors, not their bytes."""
        return bool(self.tensors)

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data (without alignment padding)."""
        return sum(m.nbytes for m in self.metas)

    @property
    def nbytes(self) -> int:
        """Bytes the bucket occupies on the wire (its used buffer, padding included)."""
        return self.metas[-1].end if self.metas else 0

    def packed(self, out: torch.Tensor | None = None) -> Bucket:
        """This bucket with its bytes in one flat buffer: itself when packed already; else a
        copy of every tensor into `out` (flat uint8 of at least `nbytes`; allocated if None)."""
        if not self.by_reference:
            return self
        out = torch.empty(self.nbytes, dtype=torch.uint8) if out is None else out
        for m, t in zip(self.metas, self.tensors, strict=True):
            out[m.offset : m.end].copy_(_as_bytes(t))
        return Bucket(self.index, out, self.metas, self.is_last)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's bytes (a copy only when it is not contiguous)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


@attrs.frozen
class BucketPlanner:
    """Packs a (name, tensor) stream into buckets of at most `bucket_bytes`.

    Attributes:
        bucket_bytes: capacity of one bucket buffer, in bytes.
        alignment: every tensor starts at a multiple of this many bytes.
        reuse_buffer: pack every bucket into the same buffer. Safe because the consumer
            acknowledges (returns control to the generator) only after it has copied or consumed
            the bucket; a consumer that keeps views past that point sees them overwritten.
        buffers: with reuse_buffer, how many buffers the buckets rotate through (consecutive
            packed buckets never share one). 2 = double buffering: bucket k+1 is packed while bucket k is still
            in flight, and the consumer must release bucket k before bucket k+2 is requested.
        lead_bytes: bytes left free at the front of every packed bucket (tensors start at the next
            aligned offset), where a transport writes its per-bucket record so that record and
            data travel as one message. Lone large tensors and empty buckets get no room.
        by_reference: copy nothing: each bucket references its tensors (`Bucket.tensors`, marked
            retained), for an engine in the same process. The tensors must stay unchanged until
            the refit ends (a trainer paused for the refit; quantized outputs nobody else holds).
            The grouping into buckets is the same as packed.
    """

    bucket_bytes: int
    alignment: int = DEFAULT_ALIGNMENT
    reuse_buffer: bool = False
    buffers: int = 1
    lead_bytes: int = 0
    by_reference: bool = False
    # With reuse_buffer, the buffers stay allocated from one pack() to the next (no page faults
    # per refit); one pack() at a time per planner.
    _pool: list[torch.Tensor | None] = attrs.field(init=False, factory=list, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise BucketLayoutError(f"alignment must be a power of two, got {self.alignment}")
        if self.bucket_bytes < self.alignment:
            raise BucketLayoutError(
                f"bucket_bytes must be at least the alignment ({self.alignment}), got "
                f"{self.bucket_bytes}; raise the bucket size"
            )
        if self.buffers < 1:
            raise BucketLayoutError(f"buffers must be >= 1, got {self.buffers}")
        if not 0 <= self.lead_bytes < self.bucket_bytes:
            raise BucketLayoutError(
                f"lead_bytes must be >= 0 and smaller than bucket_bytes ({self.bucket_bytes}), got {self.lead_bytes}"
            )

    def pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Bucket]:
        """Pack the stream, in order, into buckets; the last one has `is_last=True`.

        Args:
            named_tensors: (name, tensor) pairs in stream (layer) order. Names must be unique.

        Returns:
            An iterator of buckets with indices 0, 1, ...; the stream is read one tensor ahead,
            never more, so memory stays bounded by one bucket plus one tensor.

        Raises:
            BucketLayoutError: a name repeats or is empty.
        """
        it = iter(named_tensors)
        pending = next(it, None)
        index = 0
        pool = self._pool
        pool.extend([None] * (self.buffers - len(pool)))
        pooled = 0  # buckets packed into a pool buffer so far (lone large tensors use none)
        seen: set[str] = set()
        empty = torch.empty(0, dtype=torch.uint8)
        while True:
            shared = None
            if self.reuse_buffer and not self.by_reference:
                if pool[pooled % self.buffers] is None:
                    pool[pooled % self.buffers] = torch.empty(self.bucket_bytes, dtype=torch.uint8)
                shared = pool[pooled % self.buffers]
            buf = shared if shared is not None else None
            metas: list[TensorMeta] = []
            refs: list[torch.Tensor] = []  # by reference: the tensors themselves
            used = self.lead_bytes
            while pending is not None:
                name, t = pending
                if name in seen:
                    raise BucketLayoutError(f"tensor {name!r} appears twice in the refit stream")
                nbytes = t.numel() * t.element_size()
                offset = align_up(used, self.alignment)
                if offset + nbytes > self.bucket_bytes:
                    if metas:
                        break  # the current bucket is full: send it first
                    # Larger than a bucket: it travels alone, as a view of its own bytes.
                    seen.add(name)
                    pending = next(it, None)
                    meta = TensorMeta(name, _shape(t.shape), t.dtype, 0, nbytes)
                    if self.by_reference:
                        yield Bucket(index, empty, (meta,), pending is None, retained=True, tensors=(_contiguous(t),))
                    else:
                        yield Bucket(index, _as_bytes(t), (meta,), is_last=pending is None)
                    index += 1
                    if pending is None:
                        return
                    continue
                if self.by_reference:
                    refs.append(_contiguous(t))
                else:
                    if buf is None:
                        buf = torch.empty(self.bucket_bytes, dtype=torch.uint8)
                    buf[offset : offset + nbytes].copy_(_as_bytes(t))
                metas.append(TensorMeta(name, _shape(t.shape), t.dtype, offset, nbytes))
                seen.add(name)
                used = offset + nbytes
                pending = next(it, None)
            if self.by_reference:
                yield Bucket(index, empty, _metas(metas), pending is None, retained=True, tensors=refs)
            elif buf is None:
                yield Bucket(index, empty, (), pending is None)  # the empty last bucket of an empty stream
            else:
                # a shared buffer is kept whole (the transport slices what it sends); an own one is trimmed
                yield Bucket(index, buf if shared is not None else buf[:used], _metas(metas), pending is None)
            index += 1
            pooled += 1
            if pending is None:
                return


def pack_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    *,
    alignment: int = DEFAULT_ALIGNMENT,
    reuse_buffer: bool = False,
) -> Iterator[Bucket]:
    """Shorthand for `BucketPlanner(bucket_bytes, alignment, reuse_buffer).pack(named_tensors)`.

    Args:
        named_tensors: (name, tensor) pairs in stream order.
        bucket_bytes: capacity of one bucket.
        alignment: byte alignment of every tensor's offset.
        reuse_buffer: pack every bucket into one shared buffer.

    Returns:
        An iterator of buckets; see `BucketPlanner.pack`.
    """
    return BucketPlanner(bucket_bytes, alignment, reuse_buffer).pack(named_tensors)


def unpack_bucket(bucket: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of each tensor in the bucket's buffer (or, by reference, the tensors), without copying.

    Args:
        bucket: a bucket from `pack_buckets` (or received from a transport).

    Returns:
        (name, view) pairs in stream order. The views alias the bucket's buffer: copy them
        before acknowledging the bucket if the sender reuses its buffer.
    """
    if bucket.by_reference:
        for m, t in zip(bucket.metas, bucket.tensors, strict=True):
            yield m.name, t
        return
    for m in bucket.metas:
        raw = bucket.buffer[m.offset : m.end]
        if m.dtype != torch.uint8:
            raw = raw.view(m.dtype)
        yield m.name, raw.view(m.shape)
