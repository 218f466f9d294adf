"""In-process, zero-copy bucket streams: the source and its receivers are threads of one process.

A receiver's `consume` gets the source's own bucket (no copy); the source advances its planner
(packing the next bucket into another buffer) while receivers consume, and waits for every
receiver's acknowledgement of bucket k before it asks for bucket k + window. This is the colocated
shape (trainer and engine in one process, e.g. on the same GPUs with CUDA IPC handles standing in
for the shared buffer), the bucket streams of the in-memory RefitCollectives
(adapters.memory.collectives), and the reference the torch.distributed transport is tested against.
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

_END = object()


@attrs.define
class InProcessBroadcast:
    """One bucket stream from a source to its receivers, all threads of this process (a queue and
    acknowledgements per receiver). Receivers see the source's own bucket (zero copy) unless they
    pass `allocate`; the source reuses a buffer only after every receiver acknowledged it.

    Attributes:
        receivers: the receivers' ranks (None for the one receiver of a thread pair).
        window: buckets in flight (2 = double buffering; pair with a planner rotating through as
            many buffers).
        timeout_s: how long either side waits for the other before CollectiveTimeout.
    """

    receivers: tuple[int | None, ...]
    window: int = 2
    timeout_s: float = 60.0
    _frames: dict[int | None, queue.Queue] = attrs.field(init=False)
    _acks: dict[int | None, threading.Semaphore] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        self._frames = {r: queue.Queue() for r in self.receivers}
        self._acks = {r: threading.Semaphore(0) for r in self.receivers}

    def _wait_acks(self, rank: int | None, index: int) -> float:
        t0 = time.perf_counter()
        for r, ack in self._acks.items():
            if not ack.acquire(timeout=self.timeout_s):
                raise CollectiveTimeout(rank, f"acknowledgement of bucket {index}", self.timeout_s,
                                        () if r is None else (r,))
        return time.perf_counter() - t0

    def send(self, rank: int | None, buckets: Iterable[Bucket]) -> TransferStats:
        """The source: every bucket to every receiver, then the end (or the error that stopped it)."""
        t0 = time.perf_counter()
        n = payload = wire = 0
        blocked = 0.0
        outstanding: list[int] = []
        it = iter(buckets)
        while True:
            if len(outstanding) >= self.window:  # the buffer the next bucket reuses must be released
                blocked += self._wait_acks(rank, outstanding.pop(0))
            try:
                bucket = next(it)
            except StopIteration:
                break
            except Exception as err:
                for q in self._frames.values():
                    q.put(f"{type(err).__name__}: {err}")
                raise
            for q in self._frames.values():
                q.put(bucket)
            outstanding.append(bucket.index)
            n, payload, wire = n + 1, payload + bucket.payload_bytes, wire + bucket.nbytes
        for q in self._frames.values():
            q.put(_END)
        while outstanding:
            blocked += self._wait_acks(rank, outstanding.pop(0))
        return TransferStats(n, payload, wire, time.perf_counter() - t0, blocked)

    def receive(self, rank: int | None, consume: Callable[[Bucket], None],
                allocate: Callable[[int], torch.Tensor] | None) -> TransferStats:
        """Receiver `rank`: consume every bucket in order; the first consumer error is raised
        after the stream is drained (the source keeps sending)."""
        t0 = time.perf_counter()
        n = payload = wire = 0
        blocked = consumed = 0.0
        first_error: BaseException | None = None
        while True:
            t1 = time.perf_counter()
            try:
                item = self._frames[rank].get(timeout=self.timeout_s)
            except queue.Empty:
                raise CollectiveTimeout(rank, f"bucket {n}", self.timeout_s) from None
            blocked += time.perf_counter() - t1
            if item is _END:
                break
            if isinstance(item, str):
                raise TransportAborted(f"the source aborted the stream after {n} buckets: {item}")
            bucket: Bucket = item
            t1 = time.perf_counter()
            try:
                if first_error is None:
                    if allocate is not None:  # a buffer of the receiver's own, which it may keep
                        bucket = bucket.packed(allocate(bucket.nbytes)) if bucket.by_reference else \
                            Bucket(bucket.index, allocate(bucket.nbytes).copy_(bucket.buffer[: bucket.nbytes]),
                                   bucket.metas, bucket.is_last)
                    consume(bucket)
            except Exception as err:  # keep draining: the source is still sending
                first_error = err
            finally:
                consumed += time.perf_counter() - t1
                self._acks[rank].release()
            n, payload, wire = n + 1, payload + bucket.payload_bytes, wire + bucket.nbytes
        if first_error is not None:
            raise first_error
        return TransferStats(n, payload, wire, time.perf_counter() - t0, blocked, consumed)


@attrs.define
class InProcessTransport:
    """A BucketTransport between two threads (one source, one receiver), over an InProcessBroadcast.

    Attributes:
        window: buckets in flight at once (2 = double buffering).
        timeout_s: how long either side waits for the other before CollectiveTimeout.
    """

    window: int = 2
    timeout_s: float = 60.0
    _stream: InProcessBroadcast = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._stream = InProcessBroadcast((None,), self.window, self.timeout_s)

    def send(self, buckets: Iterable[Bucket]) -> TransferStats:
        """Hand every bucket to the receiver; see ports.bucket_transport.BucketTransport.send."""
        return self._stream.send(None, buckets)

    def receive(self, consume: Callable[[Bucket], None], allocate: Callable[[int], torch.Tensor] | None = None) -> TransferStats:
        """Consume buckets until the end; see ports.bucket_transport.BucketTransport.receive.

        Without `allocate` the consumer sees the sender's own buffer (zero copy); with it, each
        bucket is first copied into the allocated buffer, which the consumer may keep."""
        return self._stream.receive(None, consume, allocate)
