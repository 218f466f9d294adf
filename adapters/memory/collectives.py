"""In-memory RefitCollectives: every rank of a refit world is a thread of this process.

`InMemoryWorld(world)` holds what the ranks share; `world.collectives(rank)` is one rank's
RefitCollectives. Every collective is an exchange among the ranks it names (a reusable rendezvous
per group), bounded in time like the torch.distributed ones: a rank that does not arrive makes
the others raise CollectiveTimeout naming the rank and the step. Bucket streams are broadcasts
from a source to every engine rank, double-buffered like the real transport; receivers see the
source's own bucket (zero copy) unless they pass `allocate`.

It lets the distributed refit service run, and be tested, without spawning processes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import torch

from adapters.distributed.inprocess import InProcessBroadcast
from domain.errors import CollectiveTimeout
from domain.refit.buckets import Bucket
from domain.refit.status import RankStatus, TransferStats
from domain.refit.topology import RefitWorld


@attrs.define
class _Rendezvous:
    """A reusable exchange among a fixed group: each member deposits a value, all read them all."""

    members: tuple[int, ...]
    _cond: threading.Condition = attrs.field(init=False, factory=threading.Condition)
    _round: int = attrs.field(init=False, default=0)
    _pending: dict[int, Any] = attrs.field(init=False, factory=dict)
    _done: dict[int, tuple[dict[int, Any], set[int]]] = attrs.field(init=False, factory=dict)

    def exchange(self, rank: int, value: Any, step: str, timeout_s: float) -> dict[int, Any]:
        with self._cond:
            this = self._round
            self._pending[rank] = value
            if len(self._pending) == len(self.members):
                self._done[this] = (self._pending, set())
                self._pending, self._round = {}, this + 1
                self._cond.notify_all()
            elif not self._cond.wait_for(lambda: this in self._done, timeout=timeout_s):
                self._pending.pop(rank, None)
                missing = [m for m in self.members if m not in self._pending and m != rank]
                raise CollectiveTimeout(rank, step, timeout_s, tuple(missing))
            values, readers = self._done[this]
            readers.add(rank)
            if len(readers) == len(self.members):
                del self._done[this]
            return values


@attrs.define
class _Endpoint:
    """One rank's side of a InProcessBroadcast, as a BucketTransport."""

    stream: InProcessBroadcast
    rank: int

    @property
    def window(self) -> int:
        return self.stream.window

    def send(self, buckets: Iterable[Bucket]) -> TransferStats:
        return self.stream.send(self.rank, buckets)

    def receive(self, consume: Callable[[Bucket], None],
                allocate: Callable[[int], torch.Tensor] | None = None) -> TransferStats:
        return self.stream.receive(self.rank, consume, allocate)


@attrs.define
class InMemoryWorld:
    """What the ranks (threads) of one refit world share.

    Attributes:
        world: the refit world (trainer layout, engine count).
        step_timeout_s: bound on per-bucket and tensor-parallel waits.
        phase_timeout_s: bound on turns and agreements.
        window: buckets in flight per stream.
    """

    world: RefitWorld
    step_timeout_s: float = 30.0
    phase_timeout_s: float = 60.0
    window: int = 2
    _groups: dict[tuple[int, ...], _Rendezvous] = attrs.field(init=False, factory=dict)
    _streams: dict[tuple[int, int], InProcessBroadcast] = attrs.field(init=False, factory=dict)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)

    def collectives(self, rank: int) -> InMemoryCollectives:
        """Rank `rank`'s RefitCollectives."""
        self.world.role(rank)  # validates the rank
        return InMemoryCollectives(self, rank)

    def group(self, ranks: Sequence[int]) -> _Rendezvous:
        key = tuple(ranks)
        with self._lock:
            return self._groups.setdefault(key, _Rendezvous(key))

    def stream(self, source: int, refit_id: int) -> InProcessBroadcast:
        with self._lock:
            key = (source, refit_id)
            if key not in self._streams:
                self._streams = {k: v for k, v in self._streams.items() if k[1] >= refit_id - 1}
                self._streams[key] = InProcessBroadcast(self.world.engine_ranks, self.window, self.step_timeout_s)
            return self._streams[key]


@attrs.define
class InMemoryCollectives:
    """RefitCollectives of one rank (a thread) of an InMemoryWorld."""

    shared: InMemoryWorld
    rank: int

    @property
    def lead_bytes(self) -> int:
        return 0  # buckets travel as objects: no lead record

    @property
    def bucket_device(self) -> torch.device | None:
        return None  # buckets travel as objects: they stay where their tensors are

    def _tp_engines(self, source: int) -> tuple[int, ...]:
        layout = self.shared.world.layout
        c = layout.coords(source)
        return (*layout.tp_ranks(c.stage, c.ep_rank), *self.shared.world.engine_ranks)

    def agree(self, step: str, status: RankStatus) -> tuple[RankStatus, ...]:
        ranks = tuple(range(self.shared.world.size))
        values = self.shared.group(ranks).exchange(self.rank, status, f"agreement: {step}", self.shared.phase_timeout_s)
        return tuple(values[r] for r in ranks)

    def turn(self, source: int, step: str, failed: bool, next_index: int) -> tuple[bool, int]:
        values = self.shared.group(self._tp_engines(source)).exchange(
            self.rank, (failed, next_index), step, self.shared.phase_timeout_s)
        return any(f for f, _ in values.values()), max(i for _, i in values.values())

    def tp_exchange(self, holders: Sequence[int], step: str, failed: bool,
                    amax: torch.Tensor) -> tuple[bool, torch.Tensor]:
        values = self.shared.group(holders).exchange(self.rank, (failed, amax.float()), step, self.shared.step_timeout_s)
        top = torch.stack([a.reshape(()) for _, a in values.values()]).amax()  # a maximum is exact
        return any(f for f, _ in values.values()), top

    def tp_gather(self, holders: Sequence[int], step: str, piece: torch.Tensor,
                  failed: bool) -> tuple[bool, Sequence[torch.Tensor]]:
        values = self.shared.group(holders).exchange(self.rank, (failed, piece.clone()), step, self.shared.step_timeout_s)
        any_failed = any(f for f, _ in values.values())
        if self.rank != holders[0]:
            return failed, []
        return any_failed, [values[r][1] for r in holders]

    def transport(self, source: int, refit_id: int) -> _Endpoint:
        return _Endpoint(self.shared.stream(source, refit_id), self.rank)
