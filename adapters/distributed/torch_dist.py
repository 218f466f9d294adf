"""torch.distributed transport and collectives: gloo on CPU, NCCL on GPU.

TorchDistTransport broadcasts one refit's bucket stream from a source rank to a group of receivers:
per bucket a control message (header and metadata) and the flat buffer (asynchronously, so the
source packs bucket k+1 while bucket k is on the wire). Receivers post bucket k+1's receive into their second buffer
while they consume bucket k from the first. TorchDistCollectives builds every process group a
refit world needs (all ranks call it in the same order) and runs the agreement, turn and
tensor-parallel collectives. Every wait is bounded: a silent peer raises CollectiveTimeout naming
this rank and the step.
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

from adapters.distributed.wire import (
    CONTROL_BYTES,
    LEAD_BYTES,
    STATUS_BYTES,
    FrameKind,
    Header,
    StreamLayout,
    decode_control,
    decode_lead,
    decode_metas,
    decode_status,
    decode_text,
    encode_control,
    encode_lead,
    encode_metas,
    encode_status,
    encode_text,
)
from domain.errors import CollectiveTimeout, PeerLost, TransportAborted, WireProtocolError
from domain.refit.buckets import Bucket, TensorMeta
from domain.refit.sharding import RefitWorld
from domain.refit.status import RankStatus, TransferStats

_STATUS_PAD = 16  # bytes in front of a gathered piece: its holder's failure flag


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
        group: the process group ({source} + receivers).
        source: the source's global rank.
        rank: this process's global rank.
        peers: every rank in the group (for errors).
        refit_id: the refit the stream belongs to (checked in every header).
        bucket_bytes: capacity of a receive buffer (larger buckets get their own).
        timeout_s: bound on each wait.
        window: buckets in flight (2 = double buffering, 1 = none).
        device: where receive buffers live (CPU for gloo, a CUDA device for NCCL).
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
    _rbufs: list[torch.Tensor | None] = attrs.field(init=False, factory=lambda: [None, None])
    _layout: StreamLayout | None = attrs.field(init=False, default=None)

    def _bcast(self, t: torch.Tensor, step: str) -> float:
        work = dist.broadcast(t, self.source, group=self.group, async_op=True)
        return wait_work(work, self.rank, step, self.timeout_s, self.peers)

    def _bcast_async(self, t: torch.Tensor) -> Any:
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
                messages = self._lead_messages(bucket.buffer, bucket.metas, bucket.nbytes, encode_lead(header), step)
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
        control, rest = encode_control(header, body)
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

    def _abort(self, text: str, sent: int, layout: StreamLayout | None) -> None:
        """Tell the receivers the stream failed after `sent` buckets. With a known layout they
        have posted bucket `sent`'s receives: fill them with an ABORT lead record (and filler)."""
        self._layout = None  # both ends relearn the layout with the next stream
        if layout is not None and sent < len(layout):
            nbytes, metas = layout.buckets[sent]
            lead = encode_lead(Header(FrameKind.ABORT, self.refit_id, sent, layout=layout.digest), text)
            filler = torch.zeros(max(nbytes, LEAD_BYTES), dtype=torch.uint8, device=self.device)
            for what, t in self._lead_messages(filler, metas, nbytes, lead.to(self.device), f"abort of bucket {sent}"):
                self._bcast(t, what)
            return
        body = encode_text(text[:4000])
        self._control(Header(FrameKind.ABORT, self.refit_id, sent, meta_len=body.numel()), body, "abort header")

    # --- receivers ---------------------------------------------------------------------------

    def _buffer(self, n: int, nbytes: int) -> torch.Tensor:
        if nbytes > self.bucket_bytes:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)  # a lone large tensor
        slot = n % min(self.window, 2)
        buf = self._rbufs[slot]
        if buf is None:
            buf = self._rbufs[slot] = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device)
        return buf[:nbytes]

    def receive(self, consume: Callable[[Bucket], None], allocate: Callable[[int], torch.Tensor] | None = None) -> TransferStats:
        """Consume buckets until END; see ports.bucket_transport.BucketTransport.receive."""
        rx = _Receive(time.perf_counter(), consume, allocate)
        try:
            if self._layout is None:
                self._receive_learning(rx)
            else:
                self._receive_known(rx, self._layout)
        except TransportAborted:
            self._layout = None
            raise
        if rx.errors:
            raise rx.errors[0]
        return TransferStats(rx.n, rx.payload, rx.wire, time.perf_counter() - rx.t0, rx.blocked, rx.consumed)

    def _end(self, rx: _Receive, after: str) -> None:
        """The END or ABORT control message that closes every stream."""
        header, meta = self._receive_control(rx, after)
        if header.kind is FrameKind.ABORT:
            self._finish(rx, None)
            raise TransportAborted(
                f"rank {self.source} aborted the bucket stream of refit {self.refit_id} after "
                f"{header.index} buckets: {decode_text(meta)}"
            )
        if header.kind is not FrameKind.END:
            raise WireProtocolError(f"rank {self.source} sent a {header.kind.name} frame where the stream should end")

    def _receive_control(self, rx: _Receive, step: str) -> tuple[Header, torch.Tensor]:
        control = torch.empty(CONTROL_BYTES, dtype=torch.uint8)
        rx.blocked += self._bcast(control, step)
        header, meta, rest = decode_control(control, self.refit_id, self.source)
        if rest:
            more = torch.empty(rest, dtype=torch.uint8)
            rx.blocked += self._bcast(more, f"{step} (metadata)")
            meta = torch.cat([meta, more])
        return header, meta

    def _receive_learning(self, rx: _Receive) -> None:
        """A stream whose layout this end does not know yet: a control message per bucket."""
        learned = []
        while True:
            header, meta = self._receive_control(rx, f"bucket {rx.n} header")
            if header.kind is FrameKind.END:
                break
            if header.kind is FrameKind.ABORT:
                self._finish(rx, None)
                raise TransportAborted(
                    f"rank {self.source} aborted the bucket stream of refit {self.refit_id} after "
                    f"{header.index} buckets: {decode_text(meta)}"
                )
            if self.window < 2:  # one buffer: consume the previous bucket before reusing it
                self._finish(rx, None)
            metas = decode_metas(meta)
            buf = self._take(rx, header.nbytes)
            works = [self._bcast_async(buf)] if header.nbytes else []
            self._finish(rx, (Bucket(header.index, buf, metas, header.is_last), works))  # overlaps this transfer
            learned.append((header.nbytes, metas))
        self._finish(rx, None)
        self._layout = StreamLayout(tuple(learned))

    def _receive_known(self, rx: _Receive, layout: StreamLayout) -> None:
        """A stream of a known layout: post bucket k+1's receive as soon as bucket k is in, then
        consume bucket k while k+1 is on the wire."""
        pending = self._post(rx, layout, 0) if len(layout) else None
        for k in range(len(layout)):
            assert pending is not None
            buf, lead, works = pending
            for work, what in works:
                rx.blocked += wait_work(work, self.rank, what, self.timeout_s, self.peers)
            header, text = decode_lead(lead, self.refit_id, self.source)
            if header.layout != layout.digest:
                raise WireProtocolError(
                    f"rank {self.source} sent bucket {header.index} of another stream layout "
                    f"({header.layout:08x}, this rank knows {layout.digest:08x}); restart the refit world"
                )
            if header.kind is FrameKind.ABORT:
                self._finish(rx, None)
                raise TransportAborted(
                    f"rank {self.source} aborted the bucket stream of refit {self.refit_id} after {k} buckets: {text}"
                )
            bucket = Bucket(header.index, buf, layout.buckets[k][1], header.is_last)
            self._count(rx, bucket)
            if self.window < 2:  # one buffer: consume bucket k before bucket k+1 lands in it
                self._consume(rx, bucket)
            pending = self._post(rx, layout, k + 1) if k + 1 < len(layout) else None
            if self.window >= 2:
                self._consume(rx, bucket)  # overlaps bucket k+1's transfer
        self._end(rx, "end of stream")

    def _post(self, rx: _Receive, layout: StreamLayout, k: int) -> tuple[torch.Tensor, torch.Tensor, list[tuple[Any, str]]]:
        """Post every receive of bucket k of a known layout; returns (buffer, lead record, works)."""
        nbytes, metas = layout.buckets[k]
        buf = self._take(rx, nbytes, k)
        step = f"bucket {k}"
        if StreamLayout.has_lead_room(metas):
            return buf, buf[:LEAD_BYTES], [(self._bcast_async(buf), step)]
        lead = torch.empty(LEAD_BYTES, dtype=torch.uint8, device=self.device)
        works = [(self._bcast_async(lead), f"{step} lead")]
        if nbytes:
            works.append((self._bcast_async(buf), f"{step} data"))
        return buf, lead, works

    def _take(self, rx: _Receive, nbytes: int, k: int | None = None) -> torch.Tensor:
        return rx.allocate(nbytes) if rx.allocate is not None else self._buffer(rx.n if k is None else k, nbytes)

    def _finish(self, rx: _Receive, nxt: tuple[Bucket, list[Any]] | None) -> None:
        """Wait for and consume the bucket in hand, then hold `nxt` (whose receive is posted)."""
        prev, rx.held = rx.held, nxt
        if nxt is not None:
            self._count(rx, nxt[0])
        if prev is None:
            return
        bucket, works = prev
        for work in works:
            rx.blocked += wait_work(work, self.rank, f"bucket {bucket.index} data", self.timeout_s, self.peers)
        self._consume(rx, bucket)

    @staticmethod
    def _count(rx: _Receive, bucket: Bucket) -> None:
        rx.n, rx.wire, rx.payload = rx.n + 1, rx.wire + bucket.nbytes, rx.payload + bucket.payload_bytes

    @staticmethod
    def _consume(rx: _Receive, bucket: Bucket) -> None:
        if rx.errors:
            return  # drain only: the engine already failed this refit
        t1 = time.perf_counter()
        try:
            rx.consume(bucket)
        except Exception as err:
            rx.errors.append(err)
        finally:
            rx.consumed += time.perf_counter() - t1


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
    held: tuple[Bucket, list[Any]] | None = None


@attrs.define
class TorchDistCollectives:
    """RefitCollectives over torch.distributed: the process groups of one RefitWorld.

    Construct it on every rank, in the same order relative to other group creations: it creates
    the world group, one TP group per (stage, ep_rank), and per source a broadcast group
    ({source} + engines) and a turn group (its TP group + engines).

    Attributes:
        world: the refit world (layout and engine count).
        rank: this process's rank.
        step_timeout_s: bound on every per-bucket and tensor-parallel wait.
        phase_timeout_s: bound on waits that include other ranks' work (turns, agreement).
        bucket_bytes: receive buffer capacity.
        window: buckets in flight per stream (2 = double buffering).
        device: receive buffers' device (CPU for gloo; the rank's GPU for NCCL).
    """

    world: RefitWorld
    rank: int
    step_timeout_s: float = 60.0
    phase_timeout_s: float = 600.0
    bucket_bytes: int = 64 << 20
    window: int = 2
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"), converter=torch.device)
    _groups: dict[tuple[int, ...], Any] = attrs.field(init=False, factory=dict)
    _transports: dict[int, TorchDistTransport] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("TorchDistCollectives: call torch.distributed.init_process_group first")
        if dist.get_world_size() != self.world.size:
            raise ValueError(
                f"the process group has {dist.get_world_size()} ranks but the refit world needs {self.world.size} "
                f"({self.world.layout.describe()}, {self.world.engines} engines)"
            )
        timeout = datetime.timedelta(seconds=max(self.step_timeout_s, self.phase_timeout_s))
        layout, engines = self.world.layout, self.world.engine_ranks
        wanted = [tuple(range(self.world.size))]
        for stage in range(layout.pp):
            for ep_rank in range(layout.ep):
                tp = layout.tp_ranks(stage, ep_rank)
                wanted += [tp, (tp[0], *engines), (*tp, *engines)]
        for ranks in wanted:
            if ranks not in self._groups:  # the same order on every rank
                self._groups[ranks] = dist.new_group(list(ranks), timeout=timeout)

    def _group(self, ranks: Sequence[int]) -> Any:
        return self._groups[tuple(ranks)]

    @property
    def lead_bytes(self) -> int:
        """Room for the lead record in front of each packed bucket: one message per bucket."""
        return LEAD_BYTES

    def agree(self, step: str, status: RankStatus) -> tuple[RankStatus, ...]:
        ranks = tuple(range(self.world.size))
        out = [torch.empty(STATUS_BYTES, dtype=torch.uint8) for _ in ranks]
        work = dist.all_gather(out, encode_status(status), group=self._group(ranks), async_op=True)
        wait_work(work, self.rank, f"agreement: {step}", self.phase_timeout_s, ranks)
        return tuple(decode_status(t) for t in out)

    def turn(self, source: int, step: str, failed: bool, next_index: int) -> tuple[bool, int]:
        layout = self.world.layout
        c = layout.coords(source)
        ranks = (*layout.tp_ranks(c.stage, c.ep_rank), *self.world.engine_ranks)
        t = torch.tensor([int(failed), next_index], dtype=torch.int64)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group(ranks), async_op=True)
        wait_work(work, self.rank, step, self.phase_timeout_s, ranks)
        return bool(t[0]), int(t[1])

    def tp_exchange(self, holders: Sequence[int], step: str, failed: bool, amax: torch.Tensor) -> tuple[bool, torch.Tensor]:
        t = torch.tensor([float(failed), float(amax)], dtype=torch.float64)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group(holders), async_op=True)
        wait_work(work, self.rank, step, self.step_timeout_s, holders)
        return bool(t[0] > 0), t[1].to(torch.float32)

    def tp_gather(self, holders: Sequence[int], step: str, piece: torch.Tensor, failed: bool) -> tuple[bool, list[torch.Tensor]]:
        send = torch.zeros(_STATUS_PAD + piece.numel(), dtype=torch.uint8)
        send[0] = int(failed)
        send[_STATUS_PAD:] = piece
        source = holders[0]
        gather = [torch.empty_like(send) for _ in holders] if self.rank == source else None
        work = dist.gather(send, gather, dst=source, group=self._group(holders), async_op=True)
        wait_work(work, self.rank, step, self.step_timeout_s, holders)
        if gather is None:
            return failed, []
        return failed or any(bool(g[0]) for g in gather), [g[_STATUS_PAD:] for g in gather]

    def transport(self, source: int, refit_id: int) -> TorchDistTransport:
        t = self._transports.get(source)
        if t is None:
            ranks = (source, *self.world.engine_ranks)
            t = TorchDistTransport(
                self._group(ranks), source, self.rank, ranks, refit_id, self.bucket_bytes,
                self.step_timeout_s, self.window, self.device,
            )
            self._transports[source] = t  # receive buffers are kept from one refit to the next
        t.refit_id = refit_id
        return t
