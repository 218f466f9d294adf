"""Fault wrappers around the ports of one rank: they fail exactly where a real failure would.

- ScriptedFaultyEngine (RolloutEngine): a FaultScript's failure inside the engine's begin, a
  bucket's load, its finalize, its verification before commit, or the storage check after it.
- FaultyCollectives (RefitCollectives): a trainer rank's failure at begin or while the engines
  finalize (it reports a failed status at that agreement), and a source's failure while sending
  bucket K (its stream aborts, as when packing fails).
- FaultyShardedTrainer (ShardedTrainerModel): a trainer rank's failure reading its K-th export unit.

`wrap_rank` puts the right wrapper around the right port of the rank a RankFault hits; the
composition root calls it for `--inject-fault`, tests call it directly. The services under test
are the production ones, unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import attrs
import torch

from adapters.memory.faults import FaultPoint, FaultScript, RankFault
from domain.errors import InjectedFault
from domain.refit.buckets import Bucket
from domain.refit.report import EngineFinalizeResult
from domain.refit.session import CommitMode
from domain.refit.shard_map import ShardMap
from domain.refit.status import RankStatus, Role, TransferStats
from domain.refit.storage import StorageFingerprint
from ports.bucket_transport import BucketTransport
from ports.refit_collectives import RefitCollectives
from ports.rollout_engine import RolloutEngine
from ports.sharded_trainer import ShardedTrainerModel


@attrs.define
class ScriptedFaultyEngine:
    """Delegates to `inner`, failing as `script` says for its first `script.refits` refits.

    - begin: begin_refit raises before the inner engine opens the refit.
    - bucket:K: loading bucket K raises InjectedFault before the inner engine sees it (a transport
      failure); the inner engine has staged buckets 0..K-1.
    - finalize: finalize raises InjectedFault before the inner engine post-processes (a crash in
      post-processing).
    - verify: a failing verifier is added to the inner engine's `verifiers` for the refit, so the
      inner engine's own verification step fails (before its commit in transactional mode).
    - storage: the first storage fingerprint taken after the inner engine committed raises (the
      service's storage check fails after the commit).
    With `script.hang`, each of them sleeps `hang_s` first.

    Attributes:
        inner: the engine that does the work.
        script: where to fail, and which refits (`after`, `refits`).
        hang_s: how long a hanging fault sleeps before it fails.
        fired: how many refits this wrapper has failed so far.
        begun: how many refits have begun through it.
    """

    inner: RolloutEngine
    script: FaultScript
    hang_s: float = 60.0
    fired: int = 0
    begun: int = 0
    _armed: bool = attrs.field(init=False, default=False)
    _storage_armed: bool = attrs.field(init=False, default=False)
    _fired_id: int | None = attrs.field(init=False, default=None)
    _refit_id: int | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        if self.script.point is FaultPoint.VERIFY and not isinstance(getattr(self.inner, "verifiers", None), list):
            raise TypeError(
                f"{type(self.inner).__name__} has no `verifiers` list; a verify fault needs one "
                "(use bucket:K, finalize or storage instead)"
            )

    def __getattr__(self, name: str) -> object:
        """The inner engine's own queries and controls beyond the port (close, digests, ...)."""
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def commit_mode(self) -> CommitMode:
        return self.inner.commit_mode

    @property
    def is_stale(self) -> bool:
        return self.inner.is_stale

    def _fire(self, what: str) -> InjectedFault:
        if self.script.hang:
            time.sleep(self.hang_s)
        self._armed = self._storage_armed = False
        self._fired_id = self._refit_id
        self.fired += 1
        self._disarm_verifier()
        return InjectedFault(f"injected fault ({self.script}): {what}")

    def _verifier(self, group: str, staged: Mapping[str, torch.Tensor]) -> None:
        raise self._fire(f"verification of {group!r} rejected the staged weights")

    def _disarm_verifier(self) -> None:
        verifiers = getattr(self.inner, "verifiers", None)
        if isinstance(verifiers, list) and self._verifier in verifiers:
            verifiers.remove(self._verifier)

    def begin_refit(self, refit_id: int) -> None:
        # A replay of a refit this wrapper already failed (same id) is never failed again.
        self._armed = self.script.fails(self.begun) and refit_id != self._fired_id
        self._refit_id = refit_id
        self.begun += 1
        if self._armed and self.script.point is FaultPoint.BEGIN:
            raise self._fire("the engine could not open the refit")
        self.inner.begin_refit(refit_id)
        if self._armed and self.script.point is FaultPoint.VERIFY:
            self.inner.verifiers.append(self._verifier)  # type: ignore[attr-defined]

    def load_bucket(self, bucket: Bucket) -> None:
        if self._armed and self.script.point is FaultPoint.BUCKET and bucket.index == self.script.bucket_index:
            raise self._fire(f"bucket {bucket.index} was lost in transport")
        self.inner.load_bucket(bucket)

    def finalize_refit(self) -> EngineFinalizeResult:
        if self._armed and self.script.point is FaultPoint.FINALIZE:
            raise self._fire("post-processing crashed")
        try:
            result = self.inner.finalize_refit()
        finally:
            self._disarm_verifier()
        self._storage_armed = self._armed and self.script.point is FaultPoint.STORAGE
        return result

    def abort_refit(self, reason: str) -> None:
        self._disarm_verifier()
        self.inner.abort_refit(reason)

    def mark_stale(self, reason: str) -> None:
        self.inner.mark_stale(reason)

    def storage_fingerprint(self) -> StorageFingerprint:
        if self._storage_armed:
            raise self._fire("the storage check after the commit failed")
        return self.inner.storage_fingerprint()

    def log_probs(self, input_ids: torch.Tensor, *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.log_probs(input_ids, temperature=temperature)

    def live_weights(self) -> Mapping[str, torch.Tensor]:
        return self.inner.live_weights()


@attrs.define
class _Trigger:
    """One rank's fault and the refit the rank is in (counted at each `begin` agreement)."""

    fault: RankFault
    hang_s: float
    refit: int = -1
    fired: bool = False

    def hits(self, point: FaultPoint, index: int | None = None) -> bool:
        return not self.fired and self.fault.hits(self.fault.rank, self.refit, point, index)

    def fire(self, where: str) -> InjectedFault:
        self.fired = True
        if self.fault.hang:
            time.sleep(self.hang_s)
        return InjectedFault(f"injected fault ({self.fault}) on rank {self.fault.rank}: {where}")


@attrs.define
class _FaultyTransport:
    """A source's transport whose stream fails at bucket `index` (the receivers see the abort)."""

    inner: BucketTransport
    trigger: _Trigger

    @property
    def window(self) -> int:
        return self.inner.window

    def _buckets(self, buckets: Iterable[Bucket]) -> Iterator[Bucket]:
        for b in buckets:
            if self.trigger.hits(FaultPoint.BUCKET, b.index):
                raise self.trigger.fire(f"sending bucket {b.index}")
            yield b

    def send(self, buckets: Iterable[Bucket]) -> TransferStats:
        return self.inner.send(self._buckets(buckets))

    def receive(self, consume: Callable[[Bucket], None],
                allocate: Callable[[int], torch.Tensor] | None = None) -> TransferStats:
        return self.inner.receive(consume, allocate)


# The agreement at which a trainer rank reports a failure at each point.
_AGREEMENT = {FaultPoint.BEGIN: "begin", FaultPoint.FINALIZE: "finalized", FaultPoint.VERIFY: "finalized"}


@attrs.define
class FaultyCollectives:
    """RefitCollectives that report this rank's injected failure where the fault says.

    Attributes:
        inner: the real collectives.
        trigger: the fault and the refit counter it shares with this rank's other wrappers.
        points: the points carried out here (the others belong to the rank's engine or trainer).
    """

    inner: RefitCollectives
    trigger: _Trigger
    points: frozenset[FaultPoint]
    _failure: tuple[str, InjectedFault] | None = attrs.field(init=False, default=None)

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def lead_bytes(self) -> int:
        return self.inner.lead_bytes

    @property
    def bucket_device(self) -> torch.device | None:
        return self.inner.bucket_device

    def agree(self, step: str, status: RankStatus) -> tuple[RankStatus, ...]:
        if step == "begin":
            self.trigger.refit += 1
            self.trigger.fired, self._failure = False, None
        point = self.trigger.fault.point
        if point in self.points and step == _AGREEMENT.get(point) and self.trigger.hits(point):
            self._failure = (point.value, self.trigger.fire(f"at {point.value}"))
        if self._failure is not None:  # this rank failed: it says so at every agreement of the refit
            status = status.failed(*self._failure)
        return self.inner.agree(step, status)

    def turn(self, source: int, step: str, failed: bool, next_index: int) -> tuple[bool, int]:
        return self.inner.turn(source, step, failed, next_index)

    def tp_exchange(self, holders: Sequence[int], step: str, failed: bool,
                    amax: torch.Tensor) -> tuple[bool, torch.Tensor]:
        return self.inner.tp_exchange(holders, step, failed, amax)

    def tp_gather(self, holders: Sequence[int], step: str, piece: torch.Tensor,
                  failed: bool) -> tuple[bool, Sequence[torch.Tensor]]:
        return self.inner.tp_gather(holders, step, piece, failed)

    def transport(self, source: int, refit_id: int) -> BucketTransport:
        inner = self.inner.transport(source, refit_id)
        if source == self.rank and FaultPoint.BUCKET in self.points:
            return _FaultyTransport(inner, self.trigger)
        return inner


@attrs.define
class FaultyShardedTrainer:
    """A trainer rank whose read of its K-th export unit fails (in the fault's refit).

    Attributes:
        inner: the real shards.
        trigger: the fault and the refit counter it shares with the rank's collectives.
        first_members: per export unit this rank takes part in (in the order it exports them),
            the name of the unit's first tensor.
    """

    inner: ShardedTrainerModel
    trigger: _Trigger
    first_members: tuple[str, ...]

    def weight_shapes(self) -> Sequence[tuple[str, tuple[int, ...]]]:
        return self.inner.weight_shapes()

    def local_weight(self, name: str) -> torch.Tensor:
        index = self.trigger.fault.index
        if index is not None and index < len(self.first_members) and name == self.first_members[index] \
                and self.trigger.hits(FaultPoint.EXPORT, index):
            raise self.trigger.fire(f"exporting {name}")
        return self.inner.local_weight(name)


@attrs.frozen
class RankPorts:
    """One rank's ports, as the distributed refit service takes them."""

    comm: RefitCollectives
    trainer: ShardedTrainerModel | None
    engine: RolloutEngine | None


def wrap_rank(fault: RankFault | None, ports: RankPorts, role: Role, shard_map: ShardMap,
              hang_s: float = 60.0) -> RankPorts:
    """Put the fault's wrapper around the port of this rank that carries it out.

    Args:
        fault: the fault (None, or one for another rank: the ports are returned unchanged).
        ports: this rank's real ports.
        role: this rank's role.
        shard_map: the refit's placements (which units this rank exports, whether it sends).
        hang_s: how long a hanging fault sleeps.

    Returns:
        The ports, wrapped. Raises ValueError when the fault cannot happen on this rank (a bucket
        fault on a trainer rank that sends nothing, an export fault on an engine).
    """
    if fault is None or fault.rank != ports.comm.rank:
        return ports
    rank = fault.rank
    if role is Role.ENGINE:
        if fault.point is FaultPoint.EXPORT:
            raise ValueError(f"rank {rank} is an engine; export faults hit trainer ranks")
        engine = ScriptedFaultyEngine(ports.engine, fault.engine_script(), hang_s)  # type: ignore[arg-type]
        return attrs.evolve(ports, engine=engine)
    if fault.point is FaultPoint.STORAGE:
        raise ValueError(f"rank {rank} is a trainer rank; storage faults hit engines")
    sources = [s for s, _ in shard_map.segments()]
    if fault.point is FaultPoint.BUCKET and rank not in sources:
        raise ValueError(f"rank {rank} sends no buckets; bucket faults hit a source {sources} or an engine")
    trigger = _Trigger(fault, hang_s)
    points = frozenset({FaultPoint.BEGIN, FaultPoint.FINALIZE, FaultPoint.VERIFY, FaultPoint.BUCKET})
    comm = FaultyCollectives(ports.comm, trigger, points)
    trainer = ports.trainer
    if fault.point is FaultPoint.EXPORT and trainer is not None:
        units = shard_map.units_of(rank)
        if rank not in sources:  # a TP peer takes part in its source's split units only
            units = tuple(u for u in units if u.is_split)
        trainer = FaultyShardedTrainer(trainer, trigger, tuple(u.members[0].name for u in units))
    return RankPorts(comm, trainer, ports.engine)
