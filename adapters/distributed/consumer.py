"""What every bucket transport's receiver does with a bucket in hand: its consumer, run so that a
failure never stops the stream (the receiver drains it, keeping every rank in step, and raises
the first error at its end)."""

from __future__ import annotations

import time
from collections.abc import Callable

from domain.refit.buckets import Bucket


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
