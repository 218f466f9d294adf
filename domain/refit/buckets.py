"""Buckets: flat byte buffers that carry (name, tensor) pairs from the trainer to the engine.

The planner packs a stream, in order, into uint8 buffers of at most `bucket_bytes`, every tensor
at an offset aligned to `alignment` bytes. A tensor larger than a bucket travels alone (as a view
of its own bytes, without a copy). The final bucket is always marked last, even when it is empty.
A bucket lives on one device: the device of its tensors (a bucket ends where the stream's tensors
change device), or the planner's `device` where the transport needs another (a CPU device for a
transport that crosses the host; the buffers are then pinned when the tensors are on a GPU, and
filled by asynchronous copies that complete before the bucket is handed on).
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
        out = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device) if out is None else out
        for m, t in zip(self.metas, self.tensors, strict=True):
            out[m.offset : m.end].copy_(_as_bytes(t), non_blocking=out.is_pinned())
        _settle(out.device, (t.device for t in self.tensors))
        return Bucket(self.index, out, self.metas, self.is_last)

    @property
    def device(self) -> torch.device:
        """Where the bucket's bytes are: its buffer's device, or by reference its tensors'."""
        return self.tensors[0].device if self.tensors else self.buffer.device


def _settle(dest: torch.device, sources: Iterable[torch.device]) -> None:
    """Wait for the asynchronous copies from a GPU into pinned host memory at `dest` (a
    device-to-device copy stays ordered on the device's stream and needs no wait)."""
    if dest.type != "cpu":
        return
    for d in {d for d in sources if d.type == "cuda"}:
        torch.cuda.current_stream(d).synchronize()


def _allocate(nbytes: int, device: torch.device, source: torch.device) -> torch.Tensor:
    """A flat uint8 buffer on `device`; on the host for a GPU's tensors, pinned (the copies out
    of the GPU run asynchronously, at the link's full rate)."""
    pinned = device.type == "cpu" and source.type == "cuda"
    return torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pinned)


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
        device: where packed buckets' buffers live. None: on the device of their tensors (a
            bucket ends where the stream's tensors change device; a lone large tensor is a view
            of itself). A device other than the tensors' (a CPU device for a transport that
            crosses the host): every tensor is copied to it, into pinned memory when the tensors
            are on a GPU, and the copies complete before the bucket is handed on. By reference
            buckets ignore it (they never copy).
    """

    bucket_bytes: int
    alignment: int = DEFAULT_ALIGNMENT
    reuse_buffer: bool = False
    buffers: int = 1
    lead_bytes: int = 0
    by_reference: bool = False
    device: torch.device | None = attrs.field(default=None, converter=attrs.converters.optional(torch.device))
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
        self._pool.extend([None] * (self.buffers - len(self._pool)))
        pooled = 0  # buckets packed into a pool buffer so far (lone large tensors need one only off their device)
        seen: set[str] = set()
        empty = torch.empty(0, dtype=torch.uint8, device=self.device)
        while True:
            buf: torch.Tensor | None = None
            pinned = False  # buf is pinned host memory: the copies into it may run asynchronously
            home: torch.device | None = None  # the device of this bucket's tensors
            metas: list[TensorMeta] = []
            refs: list[torch.Tensor] = []  # by reference: the tensors themselves
            used = self.lead_bytes
            while pending is not None:
                name, t = pending
                if name in seen:
                    raise BucketLayoutError(f"tensor {name!r} appears twice in the refit stream")
                nbytes = t.numel() * t.element_size()
                offset = align_up(used, self.alignment)
                if metas and (offset + nbytes > self.bucket_bytes or t.device != home):
                    break  # the current bucket is full, or the next tensor lives elsewhere: send it first
                if offset + nbytes > self.bucket_bytes:
                    # Larger than a bucket: it travels alone, as a view of its own bytes (a copy only
                    # when the buckets live on another device).
                    seen.add(name)
                    pending = next(it, None)
                    meta = TensorMeta(name, _shape(t.shape), t.dtype, 0, nbytes)
                    if self.by_reference:
                        yield Bucket(index, empty, (meta,), pending is None, retained=True, tensors=(_contiguous(t),))
                    elif self.device is None or self.device == t.device:
                        yield Bucket(index, _as_bytes(t), (meta,), is_last=pending is None)
                    else:
                        own = self._buffer(pooled, nbytes, t.device)[:nbytes]
                        own.copy_(_as_bytes(t), non_blocking=own.is_pinned())
                        _settle(own.device, (t.device,))
                        pooled += 1
                        yield Bucket(index, own, (meta,), is_last=pending is None)
                    index += 1
                    if pending is None:
                        return
                    continue
                home = t.device
                if self.by_reference:
                    refs.append(_contiguous(t))
                else:
                    if buf is None:
                        buf = self._buffer(pooled, self.bucket_bytes, t.device)
                        pinned = buf.is_pinned()
                    buf[offset : offset + nbytes].copy_(_as_bytes(t), non_blocking=pinned)
                metas.append(TensorMeta(name, _shape(t.shape), t.dtype, offset, nbytes))
                seen.add(name)
                used = offset + nbytes
                pending = next(it, None)
            if self.by_reference:
                yield Bucket(index, empty, _metas(metas), pending is None, retained=True, tensors=refs)
            elif buf is None:
                yield Bucket(index, empty, (), pending is None)  # the empty last bucket of an empty stream
            else:
                if home is not None:
                    _settle(buf.device, (home,))
                # a pooled buffer is kept whole (the transport slices what it sends); an own one is trimmed
                yield Bucket(index, buf if self.reuse_buffer else buf[:used], _metas(metas), pending is None)
                pooled += 1
            index += 1
            if pending is None:
                return

    def _buffer(self, pooled: int, nbytes: int, source: torch.device) -> torch.Tensor:
        """A buffer of at least `nbytes` on the buckets' device for tensors on `source`: with
        reuse_buffer, pool buffer `pooled % buffers` (allocated once, grown only for a larger lone
        tensor, kept across refits); otherwise a fresh one."""
        device = self.device if self.device is not None else source
        if not self.reuse_buffer:
            return _allocate(nbytes, device, source)
        slot = pooled % self.buffers
        held = self._pool[slot]
        if held is None or held.numel() < nbytes or held.device != device:
            held = self._pool[slot] = _allocate(max(nbytes, self.bucket_bytes), device, source)
        return held


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
