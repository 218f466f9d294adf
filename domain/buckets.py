"""Buckets: flat byte buffers that carry (name, tensor) pairs from the trainer to the engine."""

from __future__ import annotations

import attrs
import torch


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
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


@attrs.frozen(eq=False)
class Bucket:
    """One bucket of a refit.

    Attributes:
        index: position in the refit's bucket sequence, from 0.
        buffer: flat uint8 tensor holding every tensor's bytes at its offset.
        metas: the tensors, in stream order.
        is_last: True on the final bucket of a refit (which may be empty).
    """

    index: int
    buffer: torch.Tensor
    metas: tuple[TensorMeta, ...]
    is_last: bool
