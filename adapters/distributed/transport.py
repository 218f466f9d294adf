"""A bucket transport over torch.distributed: gloo on CPU, NCCL on GPU.

TorchDistTransport broadcasts one refit's bucket stream from a source rank to a group of receivers:
per bucket a control message (header and metadata) and the flat buffer (asynchronously, so the
source packs bucket k+1 while bucket k is on the wire). Receivers post bucket k+1's receive into their second buffer
while they consume bucket k from the first. Every wait is bounded (wait_work): a silent peer raises
CollectiveTimeout naming this rank and the step. The process groups it runs over are built by
adapters.distributed.collectives.
"""

from __future__ import annotations

import collections
import datetime
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import torch

try:
    import torch.distributed as dist
except ImportError as err:  # pragma: no cover - torch built without distributed support
    raise ModuleNotFoundError("TorchDistTransport needs torch.distributed", name="torch.distributed") from err
if not dist.is_available():  # pragma: no cover
    raise ModuleNotFoundError("TorchDistTransport needs torch.distributed (this torch build lacks it)", name="torch.distributed")

from adapters.distributed.receiving import consume_draining
from adapters.distributed.side_group import SideGroup
from adapters.distributed.wire import (
    CONTROL_BYTES,
    LEAD_BYTES,
    RECEIVE_SLACK,
    FrameKind,
    Header,
    StreamLayout,
    StreamLimits,
    decode_control,
    decode_lead,
    decode_metas,
    decode_text,
    encode_control,
    encode_lead,
    encode_metas,
    encode_text,
)
from domain.errors import CollectiveTimeout, PeerLost, TransportAborted, WireProtocolError
from domain.refit.buckets import Bucket, TensorMeta
from domain.refit.status import TransferStats

_TAIL = 16  # canary bytes checked after the announced bytes and planted at their end


def wait_work(work: Any, rank: int, step: str, timeout_s: float, peers: Sequence[int]) -> float:
    """Wait for an async collective, at most `timeout_s`; returns the seconds waited.

    Raises:
        CollectiveTimeout: the collective did not complete in time (naming rank, step, peers).
        PeerLost: a peer closed its connection.
    """
    t0 = time.perf_counter()
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as err:
        text = str(err)
        if "timed out" in text.lower() or "timeout" in text.lower():
            raise CollectiveTimeout(rank, step, timeout_s, tuple(peers)) from err
        first = text.strip().splitlines()[0][:300] if text.strip() else type(err).__name__
        raise PeerLost(
            f"rank {rank}: step {step!r} with ranks {list(peers)} failed: {first}; a peer crashed or "
            "exited. Restart the refit world"
        ) from err
    return time.perf_counter() - t0


@attrs.define
class TorchDistTransport:
    """A BucketTransport over one process group: `source` broadcasts, every other member receives.

    Attributes:
        group: the process group ({source} + receivers): a group of the default world, or a
            SideGroup (then `source` and `rank` are ranks of that group).
        source: the source's global rank.
        rank: this process's global rank.
        peers: every rank in the group (for errors).
        refit_id: the refit the stream belongs to (checked in every header).
        bucket_bytes: capacity of a receive buffer (larger buckets get their own).
        timeout_s: bound on each wait.
        window: buckets in flight (2 = double buffering, 1 = none).
        device: where receive buffers live (CPU for gloo, a CUDA device for NCCL).
        max_tensor_bytes: the largest lone tensor a receiver accepts (a header announcing more is
            refused before anything is allocated).
    """

    group: Any
    source: int
    rank: int
    peers: tuple[int, ...]
    refit_id: int = 0
    bucket_bytes: int = 64 << 20
    timeout_s: float = 60.0
    window: int = 2
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"), converter=torch.device)
    max_tensor_bytes: int = 64 << 30
    _rbufs: list[torch.Tensor | None] = attrs.field(init=False, factory=lambda: [None, None])
    _layout: StreamLayout | None = attrs.field(init=False, default=None)
    _control_buf: torch.Tensor | None = attrs.field(init=False, default=None)
    _canary_bytes: tuple[int, torch.Tensor] | None = attrs.field(init=False, default=None)
    _broken: str | None = attrs.field(init=False, default=None)
    _orphans: list[Any] = attrs.field(init=False, factory=list)

    def _bcast(self, t: torch.Tensor, step: str) -> float:
        return wait_work(self._bcast_async(t), self.rank, step, self.timeout_s, self.peers)

    def _bcast_async(self, t: torch.Tensor) -> Any:
        if isinstance(self.group, SideGroup):  # a group outside the default world: its own methods
            return self.group.broadcast_async(t, self.source)
        return dist.broadcast(t, self.source, group=self.group, async_op=True)

    # --- source ------------------------------------------------------------------------------

    def send(self, buckets: Iterable[Bucket]) -> TransferStats:
        """Broadcast every bucket, then END; see ports.bucket_transport.BucketTransport.send.

        The first complete stream sends a control message per bucket (header and metadata) and
        both ends learn its StreamLayout. Later streams send each bucket as its data alone, with a
        lead record in front (in the same message where the planner left room), and check that
        every bucket still matches the layout.
        """
        t0 = time.perf_counter()
        n = payload = wire = 0
        blocked = 0.0
        layout, learned = self._layout, []
        # Per bucket in flight: its collectives (control message, buffer) and the tensors they read.
        inflight: collections.deque[list[tuple[Any, str, torch.Tensor]]] = collections.deque()
        it = iter(buckets)
        while True:
            try:
                bucket = next(it)  # packs bucket k+1 while bucket k is on the wire
                if layout is not None and (n >= len(layout) or layout.buckets[n] != (bucket.nbytes, bucket.metas)):
                    raise WireProtocolError(
                        f"bucket {bucket.index} differs from the stream layout of earlier refits (tensor names, "
                        "shapes, dtypes or bucket size changed); every rank must keep the same plan and model"
                    )
                if layout is None and encode_metas(bucket.metas).numel() > self.limits.max_meta_bytes:
                    raise WireProtocolError(
                        f"bucket {bucket.index} holds {len(bucket.metas)} tensors, whose metadata exceeds the "
                        f"{self.limits.max_meta_bytes}-byte limit receivers accept; use larger buckets' alignment or fewer tensors"
                    )
            except StopIteration:
                if layout is not None and n < len(layout):
                    err = WireProtocolError(f"the stream ended after {n} buckets; earlier refits sent {len(layout)}")
                    blocked += self._drain(inflight)
                    self._abort(str(err), n, layout)
                    raise err from None
                break
            except Exception as err:
                blocked += self._drain(inflight)
                self._abort(f"{type(err).__name__}: {err}", n, layout)
                raise
            bucket = bucket.packed()  # a bucket by reference is copied into a buffer of its own
            step = f"bucket {bucket.index}"
            if layout is None:
                meta = encode_metas(bucket.metas)
                header = Header(FrameKind.BUCKET, self.refit_id, bucket.index, bucket.is_last, bucket.nbytes, meta.numel())
                messages = [(f"{step} header", t) for t in self._control_parts(header, meta)]
                if bucket.nbytes:
                    messages.append((f"{step} data", bucket.buffer[: bucket.nbytes]))
                learned.append((bucket.nbytes, bucket.metas))
            else:
                header = Header(FrameKind.BUCKET, self.refit_id, bucket.index, bucket.is_last, bucket.nbytes,
                                layout=layout.digest)
                messages = self._lead_messages(bucket.buffer, bucket.metas, bucket.nbytes,
                                               encode_lead(header, device=bucket.buffer.device), step)
            sent = []
            for what, t in messages:
                t = t if t.device == self.device else t.to(self.device)
                sent.append((self._bcast_async(t), what, t))
            inflight.append(sent)
            n, payload, wire = n + 1, payload + bucket.payload_bytes, wire + bucket.nbytes
            if len(inflight) >= self.window:  # the oldest buffer is reused by the next bucket
                blocked += self._wait_all(inflight.popleft())
        blocked += self._drain(inflight)
        blocked += self._control(Header(FrameKind.END, self.refit_id, n), encode_text(""), "end of stream")
        if layout is None:
            self._layout = StreamLayout(tuple(learned))
        return TransferStats(n, payload, wire, time.perf_counter() - t0, blocked)

    @staticmethod
    def _lead_messages(buffer: torch.Tensor, metas: Sequence[TensorMeta], nbytes: int, lead: torch.Tensor,
                       step: str) -> list[tuple[str, torch.Tensor]]:
        """A bucket once the layout is known: one message (lead record in the room the planner left,
        then the data) or, for lone large tensors and empty buckets, the lead record and the data."""
        if StreamLayout.has_lead_room(metas):
            buffer[:LEAD_BYTES].copy_(lead)
            return [(step, buffer[:nbytes])]
        return [(f"{step} lead", lead)] + ([(f"{step} data", buffer[:nbytes])] if nbytes else [])

    def _control_parts(self, header: Header, body: torch.Tensor) -> list[torch.Tensor]:
        control, rest = encode_control(header, body, self.device)  # NCCL sends only the device's tensors
        return [control] if rest is None else [control, rest]

    def _control(self, header: Header, body: torch.Tensor, step: str) -> float:
        return sum(self._bcast(t, step) for t in self._control_parts(header, body))

    def _wait_all(self, sent: list[tuple[Any, str, torch.Tensor]]) -> float:
        return sum(wait_work(work, self.rank, step, self.timeout_s, self.peers) for work, step, _ in sent)

    def _drain(self, inflight: collections.deque[list[tuple[Any, str, torch.Tensor]]]) -> float:
        waited = 0.0
        while inflight:
            waited += self._wait_all(inflight.popleft())
        return waited

    def forget_layout(self) -> None:
        """Send (or expect) the next stream with its metadata, as a first one: a stream whose layout
        changes from refit to refit (delta refits). Both ends must call it before the same stream."""
        self._layout = None

    def _abort(self, text: str, sent: int, layout: StreamLayout | None) -> None:
        """Tell the receivers the stream failed after `sent` buckets. With a known layout they
        have posted bucket `sent`'s receives: fill them with an ABORT lead record (and filler)."""
        self._layout = None  # both ends relearn the layout with the next stream
        if layout is not None and sent < len(layout):
            nbytes, metas = layout.buckets[sent]
            lead = encode_lead(Header(FrameKind.ABORT, self.refit_id, sent, layout=layout.digest), text, self.device)
            filler = torch.zeros(max(nbytes, LEAD_BYTES), dtype=torch.uint8, device=self.device)
            for what, t in self._lead_messages(filler, metas, nbytes, lead, f"abort of bucket {sent}"):
                self._bcast(t, what)
            return
        body = encode_text(text[:4000])
        self._control(Header(FrameKind.ABORT, self.refit_id, sent, meta_len=body.numel()), body, "abort header")

    # --- receivers ---------------------------------------------------------------------------
    #
    # A receiver distrusts its source. Every header is checked against the limits and the order
    # of the stream before anything is allocated or received (StreamLimits). Over gloo, every
    # receive is posted RECEIVE_SLACK bytes larger than announced, the surplus filled with a
    # canary (the same on every receiver: gloo forwards whole receive buffers down its broadcast
    # tree): gloo terminates a process that receives more than it posted, so a source that sends
    # more than it announced lands in the surplus and is reported instead, and one that sends
    # less leaves the canary planted at the end of the announced bytes. Bytes beyond the
    # announced size are never read. (NCCL needs equal sizes on every rank: there receives are
    # posted as announced, and a lying source ends in a timeout.) After a malformed message the
    # stream is out of step: the transport refuses every later stream until the world restarts.

    @property
    def limits(self) -> StreamLimits:
        return StreamLimits(self.bucket_bytes, self.max_tensor_bytes)

    @property
    def _slack(self) -> int:
        return RECEIVE_SLACK if self.device.type == "cpu" else 0

    def _canary(self) -> torch.Tensor:
        if self._canary_bytes is None or self._canary_bytes[0] != self.refit_id:
            g = torch.Generator().manual_seed(0x5EED_0000 + self.refit_id)
            self._canary_bytes = (self.refit_id, torch.randint(0, 256, (self._slack + _TAIL,), dtype=torch.uint8, generator=g))
        return self._canary_bytes[1]

    def _buffer(self, n: int, nbytes: int) -> torch.Tensor:
        if nbytes > self.bucket_bytes:  # a lone large tensor
            return torch.empty(nbytes + self._slack, dtype=torch.uint8, device=self.device)[:nbytes]
        slot = n % min(self.window, 2)
        buf = self._rbufs[slot]
        if buf is None:
            buf = self._rbufs[slot] = torch.empty(self.bucket_bytes + self._slack, dtype=torch.uint8, device=self.device)
        return buf[:nbytes]

    def _landing(self, dest: torch.Tensor, n: int) -> tuple[torch.Tensor, bool]:
        """Where a receive for `dest` lands: `dest` with the slack after it when its storage has
        room (transport buffers always do), else a staging buffer copied into `dest` afterwards."""
        need = dest.numel() + self._slack
        storage = dest.untyped_storage()
        if dest.is_contiguous() and storage.nbytes() - dest.storage_offset() >= need:
            landing = torch.empty(0, dtype=torch.uint8, device=dest.device)
            return landing.set_(storage, dest.storage_offset(), (need,), (1,)), False
        return self._landing(self._buffer(n, dest.numel()), n)[0], True

    def _post(self, dest: torch.Tensor, step: str, n: int = 0) -> _Posted:
        """Post the receive of one message of `dest.numel()` announced bytes."""
        if not self._slack:
            return _Posted(self._bcast_async(dest), dest, dest, step, False)
        landing, staged = self._landing(dest, n)
        nbytes, canary = dest.numel(), self._canary()
        landing[nbytes:].copy_(canary[: self._slack])
        if nbytes >= _TAIL:
            landing[nbytes - _TAIL : nbytes].copy_(canary[self._slack :])
        return _Posted(self._bcast_async(landing), landing, dest, step, staged)

    def _complete(self, rx: _Receive, p: _Posted) -> None:
        """Wait for a posted receive, check it against its announced size, copy it if staged."""
        rx.blocked += wait_work(p.work, self.rank, p.step, self.timeout_s, self.peers)
        if not self._slack:
            return
        nbytes, canary = p.dest.numel(), self._canary()
        if not torch.equal(p.landing[nbytes : nbytes + _TAIL], canary[:_TAIL]):
            raise WireProtocolError(f"rank {self.source} sent more than the {nbytes} bytes it announced for "
                                    f"{p.step} (refit {self.refit_id})")
        if nbytes >= _TAIL and torch.equal(p.landing[nbytes - _TAIL : nbytes], canary[self._slack :]):
            raise WireProtocolError(f"rank {self.source} sent fewer than the {nbytes} bytes it announced for "
                                    f"{p.step} (refit {self.refit_id})")
        if p.staged:
            p.dest.copy_(p.landing[:nbytes])

    def receive(self, consume: Callable[[Bucket], None], allocate: Callable[[int], torch.Tensor] | None = None) -> TransferStats:
        """Consume buckets until END; see ports.bucket_transport.BucketTransport.receive.

        Raises WireProtocolError (before allocating or receiving what a bad header announces)
        when the source's stream breaks the wire format or its limits; the transport then
        refuses every later stream (the ranks are out of step: restart the world).
        """
        if self._broken is not None:
            raise WireProtocolError(f"the bucket stream from rank {self.source} is out of step since {self._broken}; "
                                    "restart the refit world")
        rx = _Receive(time.perf_counter(), consume, allocate)
        try:
            if self._layout is None:
                self._receive_learning(rx)
            else:
                self._receive_known(rx, self._layout)
        except TransportAborted:
            self._layout = None
            raise
        except WireProtocolError as err:
            self._broken, self._layout = f"refit {self.refit_id} ({err})", None
            self._orphans.append(rx)  # receives may still be posted into its buffers: keep them alive
            raise
        if rx.errors:
            raise rx.errors[0]
        return TransferStats(rx.n, rx.payload, rx.wire, time.perf_counter() - rx.t0, rx.blocked, rx.consumed)

    def _aborted(self, rx: _Receive, index: int, text: str) -> TransportAborted:
        self._finish(rx, None)
        return TransportAborted(f"rank {self.source} aborted the bucket stream of refit {self.refit_id} after "
                                f"{index} buckets: {text}")

    def _end(self, rx: _Receive, after: str, count: int) -> None:
        """The END or ABORT control message that closes every stream."""
        header, meta = self._receive_control(rx, after)
        if header.kind is FrameKind.ABORT:
            raise self._aborted(rx, header.index, decode_text(meta))
        if header.kind is not FrameKind.END:
            raise WireProtocolError(f"rank {self.source} sent bucket {header.index} after the last bucket of the "
                                    f"stream layout it follows ({count} buckets)")
        self.limits.check_end(header, self.source, count)

    def _receive_control(self, rx: _Receive, step: str) -> tuple[Header, torch.Tensor]:
        if self._control_buf is None:
            self._control_buf = torch.empty(CONTROL_BYTES + self._slack, dtype=torch.uint8, device=self.device)
        control = self._control_buf[:CONTROL_BYTES]
        self._complete(rx, self._post(control, step))
        header, meta, rest = decode_control(control, self.refit_id, self.source)
        limits = self.limits
        if header.kind is FrameKind.BUCKET:
            limits.check_header(header, self.source, rx.next_index, rx.after_last)
        elif header.kind is FrameKind.ABORT:
            limits.check_abort(header, self.source)
        meta = meta.clone()
        if rest:
            more = torch.empty(rest + self._slack, dtype=torch.uint8, device=self.device)[:rest]
            self._complete(rx, self._post(more, f"{step} (metadata)"))
            meta = torch.cat([meta, more])
        return header, meta

    def _receive_learning(self, rx: _Receive) -> None:
        """A stream whose layout this end does not know yet: a control message per bucket."""
        learned = []
        while True:
            header, meta = self._receive_control(rx, f"bucket {rx.n} header")
            if header.kind is FrameKind.END:
                self._finish(rx, None)
                self.limits.check_end(header, self.source, rx.n)
                break
            if header.kind is FrameKind.ABORT:
                raise self._aborted(rx, header.index, decode_text(meta))
            metas = decode_metas(meta)
            self.limits.check_metas(header, metas, self.source)
            rx.next_index, rx.after_last = header.index + 1, header.is_last
            if self.window < 2:  # one buffer: consume the previous bucket before reusing it
                self._finish(rx, None)
            buf = self._take(rx, header.nbytes)
            posted = [self._post(buf, f"bucket {header.index} data", rx.n)] if header.nbytes else []
            self._finish(rx, (Bucket(header.index, buf, metas, header.is_last), posted))  # overlaps this transfer
            learned.append((header.nbytes, metas))
        self._layout = StreamLayout(tuple(learned))

    def _receive_known(self, rx: _Receive, layout: StreamLayout) -> None:
        """A stream of a known layout: post bucket k+1's receive as soon as bucket k is in, then
        consume bucket k while k+1 is on the wire."""
        pending = rx.pending = self._post_known(rx, layout, 0) if len(layout) else None
        for k in range(len(layout)):
            assert pending is not None
            buf, lead, posted = pending
            for p in posted:
                self._complete(rx, p)
            header, text = decode_lead(lead, self.refit_id, self.source)
            if header.layout != layout.digest:
                raise WireProtocolError(
                    f"rank {self.source} sent bucket {header.index} of another stream layout "
                    f"({header.layout:08x}, this rank knows {layout.digest:08x}); restart the refit world"
                )
            if header.kind is FrameKind.ABORT:
                raise self._aborted(rx, k, text)
            self._check_lead(rx, header, layout, k)
            bucket = Bucket(header.index, buf, layout.buckets[k][1], header.is_last)
            self._count(rx, bucket)
            if self.window < 2:  # one buffer: consume bucket k before bucket k+1 lands in it
                self._consume(rx, bucket)
            pending = rx.pending = self._post_known(rx, layout, k + 1) if k + 1 < len(layout) else None
            if self.window >= 2:
                self._consume(rx, bucket)  # overlaps bucket k+1's transfer
        self._end(rx, "end of stream", len(layout))

    def _check_lead(self, rx: _Receive, h: Header, layout: StreamLayout, k: int) -> None:
        """A lead record must be bucket k of the layout: its size, the next index, last only at the end."""
        if h.kind is not FrameKind.BUCKET:
            raise WireProtocolError(f"rank {self.source} sent a {h.kind.name} lead record for bucket {k}")
        self.limits.check_header(attrs.evolve(h, meta_len=0), self.source, rx.next_index, rx.after_last)
        if h.nbytes != layout.buckets[k][0]:
            raise WireProtocolError(f"rank {self.source} announced {h.nbytes} bytes for bucket {h.index}; its stream "
                                    f"layout has {layout.buckets[k][0]}")
        if h.is_last and k + 1 < len(layout):
            raise WireProtocolError(f"rank {self.source} marked bucket {h.index} last, {len(layout) - k - 1} buckets "
                                    "before the end of its stream layout")
        rx.next_index, rx.after_last = h.index + 1, h.is_last

    def _post_known(self, rx: _Receive, layout: StreamLayout, k: int) -> tuple[torch.Tensor, torch.Tensor, list[_Posted]]:
        """Post every receive of bucket k of a known layout; returns (buffer, lead record, receives)."""
        nbytes, metas = layout.buckets[k]
        buf = self._take(rx, nbytes, k)
        step = f"bucket {k}"
        if StreamLayout.has_lead_room(metas):
            return buf, buf[:LEAD_BYTES], [self._post(buf, step, k)]
        lead = torch.empty(LEAD_BYTES + self._slack, dtype=torch.uint8, device=self.device)[:LEAD_BYTES]
        posted = [self._post(lead, f"{step} lead")]
        if nbytes:
            posted.append(self._post(buf, f"{step} data", k))
        return buf, lead, posted

    def _take(self, rx: _Receive, nbytes: int, k: int | None = None) -> torch.Tensor:
        if rx.allocate is not None:  # the consumer's own buffer, with the slack after it: received in place
            return rx.allocate(nbytes + self._slack)[:nbytes]
        return self._buffer(rx.n if k is None else k, nbytes)

    def _finish(self, rx: _Receive, nxt: tuple[Bucket, list[_Posted]] | None) -> None:
        """Wait for and consume the bucket in hand, then hold `nxt` (whose receive is posted)."""
        prev, rx.held = rx.held, nxt
        if nxt is not None:
            self._count(rx, nxt[0])
        if prev is None:
            return
        bucket, posted = prev
        for p in posted:
            self._complete(rx, p)
        self._consume(rx, bucket)

    @staticmethod
    def _count(rx: _Receive, bucket: Bucket) -> None:
        rx.n, rx.wire, rx.payload = rx.n + 1, rx.wire + bucket.nbytes, rx.payload + bucket.payload_bytes

    @staticmethod
    def _consume(rx: _Receive, bucket: Bucket) -> None:
        rx.consumed += consume_draining(rx.consume, bucket, rx.errors)


@attrs.frozen
class _Posted:
    """One posted receive: where it lands (announced bytes, then the slack), and where the bytes go."""

    work: Any
    landing: torch.Tensor
    dest: torch.Tensor
    step: str
    staged: bool


@attrs.define
class _Receive:
    """One receive call's state."""

    t0: float
    consume: Callable[[Bucket], None]
    allocate: Callable[[int], torch.Tensor] | None
    n: int = 0
    payload: int = 0
    wire: int = 0
    blocked: float = 0.0
    consumed: float = 0.0
    errors: list[BaseException] = attrs.field(factory=list)
    held: tuple[Bucket, list[_Posted]] | None = None
    next_index: int | None = None  # the index the next bucket must have (None: any, the first)
    after_last: bool = False  # a bucket marked last has arrived
    pending: Any = None  # a known-layout bucket's posted receives
