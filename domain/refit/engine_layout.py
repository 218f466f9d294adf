"""The checkpoint layout an engine expects, and the check of each arriving bucket against it.

Engines' own loaders are lenient (an unknown name may be skipped, a float32 tensor silently cast
into a BF16 parameter); adapters that know the expected layout reject such tensors before the
engine sees them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from domain.errors import EngineTensorMismatch
from domain.refit.buckets import Bucket
from domain.refit.delta import checkpoint_name

Layout = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


def layout_of(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The layout (name -> (shape, dtype)) of a sample refit stream.

    Args:
        named_tensors: (name, tensor) pairs in checkpoint format.

    Returns:
        name -> (shape, dtype).
    """
    return {n: (tuple(t.shape), t.dtype) for n, t in named_tensors}


def check_bucket(bucket: Bucket, expected: Layout, seen: set[str]) -> None:
    """Reject a bucket holding a tensor the engine has no place for, of the wrong shape or dtype,
    or already sent in this refit.

    Args:
        bucket: the arriving bucket.
        expected: the engine's layout (name -> (shape, dtype)).
        seen: names received so far in this refit; this bucket's names are added.

    Returns:
        None. Raises EngineTensorMismatch naming the tensor.
    """
    names = []
    for m in bucket.metas:
        name, record = checkpoint_name(m.name)
        if name not in expected:
            raise EngineTensorMismatch(f"tensor {name!r} has no place in the engine; check the plan and the model")
        shape, dtype = expected[name]
        if record:  # a delta record: its tensor's shape and dtype are the receiver's copy's
            shape, dtype = tuple(m.shape), torch.uint8
        if tuple(m.shape) != tuple(shape) or m.dtype != dtype:
            raise EngineTensorMismatch(
                f"tensor {name!r}: got {m.dtype} {tuple(m.shape)}, the engine expects {dtype} {tuple(shape)}; "
                "trainer and engine plans differ"
            )
        if name in seen or name in names:
            raise EngineTensorMismatch(f"tensor {name!r} arrived twice in one refit")
        names.append(name)
    seen.update(names)
