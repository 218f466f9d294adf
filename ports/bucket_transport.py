"""Port: moves a refit's buckets from one source to its receivers, in order."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from domain.refit.buckets import Bucket
from domain.refit.status import TransferStats


class BucketTransport(Protocol):
    """One source, one or more receivers, one refit's bucket stream at a time.

    The source calls `send`, every receiver calls `receive`. Buckets arrive in the order they
    were sent, exactly once. A receiver sees each bucket's buffer only while its `consume` runs
    and must copy or consume the bytes before returning (the acknowledgement); the source reuses
    a buffer only after every receiver has acknowledged the bucket that used it, so a planner
    rotating through `window` buffers may pack bucket k+1 while bucket k is in flight.
    """

    @property
    def window(self) -> int:
        """Buckets that may be in flight at once (1 = no overlap, 2 = double buffering)."""
        ...

    def send(self, buckets: Iterable[Bucket]) -> TransferStats:
        """Source side: send every bucket, then the end of the stream.

        Args:
            buckets: the stream, typically a lazy planner; it is advanced only when a buffer is
                free, so packing bucket k+1 overlaps sending bucket k.

        Returns:
            TransferStats, once every bucket is acknowledged. If `buckets` raises, the receivers
            are told the stream aborted (with the error's text) and the error is re-raised.
            Raises CollectiveTimeout naming the rank and step when a receiver does not keep up.
        """
        ...

    def receive(
        self, consume: Callable[[Bucket], None], allocate: Callable[[int], torch.Tensor] | None = None
    ) -> TransferStats:
        """Receiver side: call `consume(bucket)` for each bucket, in order, until the end.

        Args:
            consume: copies or consumes the bucket before returning (e.g. an engine's load_bucket).
            allocate: `allocate(nbytes)` returns a flat uint8 tensor of nbytes to receive one bucket
                into; the consumer may then keep that bucket (no copy needed). None: the transport
                reuses its own buffers and the consumer must copy what it keeps.

        Returns:
            TransferStats. When `consume` raises, the stream is still drained to its end (so every
            rank stays in step) and the first error is raised then. Raises TransportAborted when
            the source aborted the stream, CollectiveTimeout when the source goes silent.
        """
        ...
