"""In-process, zero-copy bucket transport: the sender and the receiver are two threads of one process.

The receiver's `consume` gets the sender's own bucket (no copy); the sender advances its planner
(packing the next bucket into another buffer) while the receiver consumes, and waits for the
receiver's acknowledgement of bucket k before it asks for bucket k + window. This is the colocated
shape (trainer and engine in one process, e.g. on the same GPUs with CUDA IPC handles standing in
for the shared buffer) and the reference the torch.distributed transport is tested against.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable

import attrs
import torch

from domain.errors import CollectiveTimeout, TransportAborted
from domain.refit.buckets import Bucket
from domain.refit.status import TransferStats

_BUCKET, _END, _ABORT = "bucket", "end", "abort"


@attrs.define
class InProcessTransport:
    """A BucketTransport between two threads (one sender, one receiver).

    Attributes:
        window: buckets in flight at once (2 = double buffering; pair with a planner rotating
            through as many buffers).
        timeout_s: how long either side waits for the other before CollectiveTimeout.
    """

    window: int = 2
    timeout_s: float = 60.0
    _frames: queue.Queue = attrs.field(init=False, factory=queue.Queue)
    _acks: threading.Semaphore = attrs.field(init=False, factory=lambda: threading.Semaphore(0))

    def __attrs_post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    def _wait_ack(self, step: str) -> float:
        t0 = time.perf_counter()
        if not self._acks.acquire(timeout=self.timeout_s):
            raise CollectiveTimeout(None, step, self.timeout_s)
        return time.perf_counter() - t0

    def send(self, buckets: Iterable[Bucket]) -> TransferStats:
        """Hand every bucket to the receiver; see ports.bucket_transport.BucketTransport.send."""
        t0 = time.perf_counter()
        n = payload = wire = 0
        blocked = 0.0
        outstanding = 0
        it = iter(buckets)
        while True:
            if outstanding >= self.window:  # the buffer the next bucket reuses must be released
                blocked += self._wait_ack(f"acknowledgement of bucket {n - outstanding}")
                outstanding -= 1
            try:
                bucket = next(it)
            except StopIteration:
                break
            except Exception as err:
                self._frames.put((_ABORT, f"{type(err).__name__}: {err}"))
                raise
            self._frames.put((_BUCKET, bucket))
            outstanding += 1
            n, payload, wire = n + 1, payload + bucket.payload_bytes, wire + bucket.nbytes
        self._frames.put((_END, None))
        while outstanding:
            blocked += self._wait_ack(f"acknowledgement of bucket {n - outstanding}")
            outstanding -= 1
        return TransferStats(n, payload, wire, time.perf_counter() - t0, blocked)

    def receive(self, consume: Callable[[Bucket], None], allocate: Callable[[int], torch.Tensor] | None = None) -> TransferStats:
        """Consume buckets until the end; see ports.bucket_transport.BucketTransport.receive.

        Without `allocate` the consumer sees the sender's own buffer (zero copy); with it, each
        bucket is first copied into the allocated buffer, which the consumer may keep."""
        t0 = time.perf_counter()
        n = payload = wire = 0
        blocked = consumed = 0.0
        first_error: BaseException | None = None
        while True:
            t1 = time.perf_counter()
            try:
                kind, item = self._frames.get(timeout=self.timeout_s)
            except queue.Empty:
                raise CollectiveTimeout(None, f"bucket {n}", self.timeout_s) from None
            blocked += time.perf_counter() - t1
            if kind == _END:
                break
            if kind == _ABORT:
                raise TransportAborted(f"the source aborted the stream after {n} buckets: {item}")
            t1 = time.perf_counter()
            try:
                if first_error is None:
                    if allocate is not None:
                        own = allocate(item.nbytes)
                        if item.by_reference:
                            item = item.packed(own)
                        else:
                            own.copy_(item.buffer[: item.nbytes])
                            item = Bucket(item.index, own, item.metas, item.is_last)
                    consume(item)
            except Exception as err:  # keep draining: the sender is still sending
                first_error = err
            finally:
                consumed += time.perf_counter() - t1
                self._acks.release()
            n, payload, wire = n + 1, payload + item.payload_bytes, wire + item.nbytes
        if first_error is not None:
            raise first_error
        return TransferStats(n, payload, wire, time.perf_counter() - t0, blocked, consumed)
