"""What every bucket transport's receiver shares: where a bucket it keeps is received into, and
how its consumer runs, so that a failure never stops the stream (the receiver drains it, keeping
every rank in step, and raises the first error at its end)."""

from __future__ import annotations

import contextlib
import mmap
import time
from collections.abc import Callable

import torch

from domain.refit.buckets import Bucket

_HUGE = 2 << 20  # buffers from this size up are mapped for huge pages


def consume_draining(consume: Callable[[Bucket], None], bucket: Bucket, errors: list[BaseException]) -> float:
    """Run `consume(bucket)` unless an earlier bucket's consumer failed (then the stream is only
    drained); an error it raises is appended to `errors`. Returns the seconds it ran."""
    if errors:
        return 0.0
    t0 = time.perf_counter()
    try:
        consume(bucket)
    except Exception as err:
        errors.append(err)
    return time.perf_counter() - t0


def receive_buffer(nbytes: int) -> torch.Tensor:
    """A flat uint8 CPU buffer of `nbytes` in memory of its own, backed by huge pages where the
    kernel allows (transparent huge pages on `madvise`): a receiver that keeps each bucket in a
    fresh buffer (`allocate`) faults its pages in 2 MiB at a time instead of 4 KiB, which on
    CPU is most of what a fresh buffer costs. The memory goes back to the system with the tensor."""
    if nbytes < _HUGE:
        return torch.empty(nbytes, dtype=torch.uint8)
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages: small pages
            area.madvise(advice)
    return torch.frombuffer(area, dtype=torch.uint8)  # keeps the mapping alive; unmapped with it
