"""DistributedRefitService: one refit across trainer and engine processes, failing together.

Every rank of a RefitWorld runs `refit()` at the same time. The ranks agree three times:

1. `begin`: every rank is configured alike (refit id, plan, layout, model) and every engine began;
2. `staged`: every source exported and sent its segment, every engine loaded every bucket;
3. `finalized`: every engine post-processed, committed and passed its storage check; trainers
   report any failure of theirs in the meantime.

Between 1 and 2 the sources take turns, stage by stage (a turn is a small collective of the
source's TP group and the engines, which also carries the next bucket index and stops later
sources once anything failed). When any rank reports a failure at any agreement, every rank
settles the same refit (app.services.lifecycle): engines that had not committed abort it (live
weights kept; per-layer engines that wrote some layers become stale); engines that had committed
replay the previous refit's buckets (kept on the host for that purpose) or mark themselves
stale; then a fourth agreement, `settled`, tells every rank what each engine did and all raise the
same DistributedRefitFailed. A collective that times out (a hung peer) or loses its peer ends the
refit on this rank at once with CollectiveTimeout / PeerLost; the world is unusable afterwards.
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Iterable, Iterator, Sequence

import attrs
import structlog
import torch

from app.services.lifecycle import begin_engine, commit_engine, describe_plan, settle_engine
from app.services.shard_export import ShardExporter
from domain.errors import (
    CollectiveTimeout,
    ConfigError,
    DistributedRefitFailed,
    PeerLost,
    RefitLifecycleError,
)
from domain.quant.plan import QuantizationPlan
from domain.refit.buckets import DEFAULT_ALIGNMENT, Bucket, BucketPlanner
from domain.refit.report import RefitReport
from domain.refit.run import RefitRun, StageClock
from domain.refit.session import CommitMode
from domain.refit.shard_map import ExportUnit, ShardMap
from domain.refit.status import EngineState, RankStatus, failure_summary
from domain.refit.storage import StorageFingerprint
from domain.refit.topology import RefitWorld, Role
from ports.refit_collectives import RefitCollectives
from ports.rollout_engine import RolloutEngine
from ports.sharded_trainer import ShardedTrainerModel

log = structlog.get_logger()
PHASES = ("export", "pack", "stream", "wire", "load", "finalize", "verify", "agree", "total")


class Restore(enum.Enum):
    """What an engine that committed a refit does when the refit fails elsewhere."""

    REPLAY = "replay"  # replay the previous refit's buckets (host memory: one quantized copy)
    STALE = "stale"  # mark itself stale until a full refit succeeds (no extra memory)


@attrs.define
class _Rank:
    """One refit's state on this rank: the shared run, plus what the agreements need."""

    run: RefitRun
    status: RankStatus
    next_index: int = 0
    before: StorageFingerprint | None = None
    incoming: list[Bucket] = attrs.field(factory=list)

    def fail(self, step: str, err: BaseException | str) -> None:
        self.status = self.status.failed(step, err)
        self.run.fail(step, err)


@attrs.define
class _BufferPool:
    """Receive buffers an engine keeps as its replay copy, recycled from one refit to the next:
    the bytes land once, where they are kept, with no copy and (after the first refits) no
    allocation."""

    capacity: int
    free: list[torch.Tensor] = attrs.field(factory=list)

    def take(self, nbytes: int) -> torch.Tensor:
        for i, b in enumerate(self.free):
            if b.numel() >= nbytes:
                return self.free.pop(i)[:nbytes]
        return torch.empty(max(nbytes, self.capacity), dtype=torch.uint8)[:nbytes]

    def give(self, buckets: Iterable[Bucket]) -> None:
        for b in buckets:  # the whole allocation behind the bucket's view
            self.free.append(torch.empty(0, dtype=torch.uint8).set_(b.buffer.untyped_storage()))


@attrs.define
class DistributedRefitService:
    """This rank's side of a distributed refit.

    Attributes:
        world: the refit world (trainer layout, engine count).
        comm: the collectives (TorchDistCollectives on torch.distributed, or the in-memory ones).
        plan: the rollout quantization plan, the same on every rank.
        shapes: the full model's (name, shape), in layer order (engines need it for the segments).
        trainer: this rank's shards (trainer ranks).
        engine: the rollout engine (engine ranks), a full replica.
        bucket_bytes: bucket capacity.
        alignment: byte alignment in buckets.
        window: buckets in flight per stream (2 = double buffering, 1 = none).
        restore: what an engine that committed does when the refit fails elsewhere; None = replay
            for transactional engines, stale for per-layer ones (bounded memory).
        reports: this rank's report of every refit.
    """

    world: RefitWorld
    comm: RefitCollectives
    plan: QuantizationPlan
    shapes: Sequence[tuple[str, tuple[int, ...]]]
    trainer: ShardedTrainerModel | None = None
    engine: RolloutEngine | None = None
    bucket_bytes: int = 64 << 20
    alignment: int = DEFAULT_ALIGNMENT
    window: int = 2
    restore: Restore | None = attrs.field(default=None, converter=attrs.converters.optional(Restore))
    reports: list[RefitReport] = attrs.field(factory=list)
    shard_map: ShardMap = attrs.field(init=False)
    _next_id: int = attrs.field(init=False, default=1)
    _replay: list[Bucket] | None = attrs.field(init=False, default=None)
    _pool: _BufferPool = attrs.field(init=False)
    _planner: BucketPlanner = attrs.field(init=False)
    _broken: str | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        role = self.role
        if (role is Role.TRAINER) != (self.trainer is not None) or (role is Role.ENGINE) != (self.engine is not None):
            raise ConfigError("distributed refit", f"rank {self.rank} is a {role.value} rank: give it a {role.value} only")
        if self.window not in (1, 2):
            raise ConfigError("window", f"must be 1 (no overlap) or 2 (double buffering), got {self.window}")
        if self.trainer is not None and [tuple(x) for x in self.trainer.weight_shapes()] != [tuple(x) for x in self.shapes]:
            raise ConfigError("distributed refit", f"rank {self.rank}: the trainer's weights differ from the model "
                              "the refit was configured with (names or shapes); give every rank the same model")
        self.shard_map = ShardMap.build(self.world.layout, self.shapes, self.plan)
        self._pool = _BufferPool(self.bucket_bytes)
        # One planner for every refit: its `window` buffers stay allocated (validated sizes, too).
        # Packed buckets leave the room the transport asks for in front (its lead record: one
        # message per bucket).
        self._planner = BucketPlanner(self.bucket_bytes, self.alignment, reuse_buffer=True, buffers=self.window,
                                      lead_bytes=self.comm.lead_bytes)

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def broken(self) -> str | None:
        """Why the world cannot run more refits (a collective timed out or lost a peer), or None."""
        return self._broken

    @property
    def role(self) -> Role:
        return self.world.role(self.rank)

    @property
    def restore_policy(self) -> Restore:
        if self.restore is not None:
            return self.restore
        mode = self.engine.commit_mode if self.engine is not None else CommitMode.TRANSACTIONAL
        return Restore.REPLAY if mode is CommitMode.TRANSACTIONAL else Restore.STALE

    def _fingerprint(self, refit_id: int) -> str:
        key = repr((refit_id, self.plan, self.world, tuple(self.shapes), self.bucket_bytes, self.alignment))
        return f"{zlib.crc32(key.encode()):08x}"

    # --- the refit -------------------------------------------------------------------------

    def refit(self) -> RefitReport:
        """Run one refit on this rank, in step with every other rank of the world.

        Returns:
            This rank's RefitReport of a refit that is live on every engine.

        Raises:
            DistributedRefitFailed: any rank failed; it carries this rank's report and every
                rank's final status (the same on every rank).
            CollectiveTimeout / PeerLost: a peer hung or vanished; `.report` is this rank's report.
                The world cannot run further refits (nor after any other unexpected error mid-protocol).
        """
        if self._broken is not None:
            raise RefitLifecycleError(f"rank {self.rank}: the refit world is unusable ({self._broken}); restart it")
        refit_id, self._next_id = self._next_id, self._next_id + 1
        commit_mode = self.engine.commit_mode.value if self.engine is not None else None
        run = RefitRun(refit_id, describe_plan(self.plan), self.bucket_bytes, commit_mode, PHASES)
        r = _Rank(run, RankStatus(self.rank, self.role.value, fingerprint=self._fingerprint(refit_id)))
        try:
            run.open()
            self._begin(r)
            ok = self._agree(r, "begin")
            if ok:
                self._stream(r)
                ok = self._agree(r, "staged")
            if ok:
                run.finalizing()
                self._finalize(r)
                ok = self._agree(r, "finalized")
            if ok:
                return self._succeeded(r)
            self._settle(r)
            statuses = self.comm.agree("settled", r.status)
        except Exception as err:  # a timeout, a lost peer, or a bug: peers' positions are unknown
            self._broken = f"{type(err).__name__} at {getattr(err, 'step', run.where)!r}"
            r.fail(run.where or "collective", err)
            self._settle(r)
            report = run.report()
            self.reports.append(report)
            if isinstance(err, CollectiveTimeout | PeerLost):
                err.report = report
            log.error("distributed refit", rank=self.rank, role=self.role.value, **report.log_fields())
            raise
        report = run.report(failure_summary(refit_id, statuses), statuses)
        self.reports.append(report)
        log.error("distributed refit", rank=self.rank, role=self.role.value, **report.log_fields())
        raise DistributedRefitFailed(report.error or "", report=report, statuses=statuses)

    def _agree(self, r: _Rank, step: str) -> bool:
        with r.run.phase("agree", where=f"agreement {step!r}"):
            statuses = self.comm.agree(step, r.status)
        if step == "begin":
            reference = statuses[0].fingerprint
            odd = [s.rank for s in statuses if s.fingerprint != reference]
            if odd and self.rank in odd:
                r.fail("begin", f"configured differently from rank 0 (refit id, plan, layout, model or "
                       f"bucket size differ on ranks {odd}); start every rank with the same settings")
            return not odd and all(s.ok for s in statuses)
        return all(s.ok for s in statuses)

    def _begin(self, r: _Rank) -> None:
        if self.engine is None:
            return
        try:
            r.before = begin_engine(self.engine, r.run)
        except Exception as err:
            r.fail("begin", err)

    def _stream(self, r: _Rank) -> None:
        segments = self.shard_map.segments()
        layout = self.world.layout
        for source, units in segments:
            c = layout.coords(source)
            tp = layout.tp_ranks(c.stage, c.ep_rank)
            if self.rank not in tp and self.role is not Role.ENGINE:
                continue
            with r.run.phase("agree", where=f"turn of rank {source}"):
                failed, offset = self.comm.turn(source, r.run.where, not r.status.ok, r.next_index)
            if failed:
                continue  # a rank already failed: nobody sends more
            if self.rank == source:
                self._send(r, units, offset, final=source == segments[-1][0])
            elif self.rank in tp:
                self._serve(r, source, units)
            else:
                self._receive(r, source)

    def _exporter(self) -> ShardExporter:
        return ShardExporter(self.plan, self.shard_map, self.trainer, self.comm)  # type: ignore[arg-type]

    def _send(self, r: _Rank, units: Sequence[ExportUnit], offset: int, final: bool) -> None:
        exporter = self._exporter()
        gen = exporter.stream(units)
        clock = StageClock()
        packed = self._planner.pack(clock.timed("export", gen))
        buckets = _numbered(exporter, clock.timed("pack", packed), offset, final)
        stats = None
        try:
            stats = self.comm.transport(self.rank, r.run.refit_id).send(_counted(r.run, buckets))
        except (CollectiveTimeout, PeerLost):
            raise
        except Exception as err:
            r.fail(exporter.where, err)
        finally:
            gen.close()  # an unfinished export tells its TP peers to stop
            r.run.source_bytes += exporter.source_bytes
            r.run.add_times(clock.exclusive(("export", "pack")))
            if stats is not None:
                r.run.bytes_sent, r.run.buckets = stats.payload_bytes, stats.buckets
                r.run.add_times({"stream": stats.seconds, "wire": stats.blocked_seconds})

    def _serve(self, r: _Rank, source: int, units: Sequence[ExportUnit]) -> None:
        exporter = self._exporter()
        try:
            with r.run.phase("export"):
                exporter.serve(source, units)
        except (CollectiveTimeout, PeerLost):
            raise
        except Exception as err:
            r.fail(exporter.where, err)
        finally:
            r.run.source_bytes += exporter.source_bytes

    def _receive(self, r: _Rank, source: int) -> None:
        keep = self.restore_policy is Restore.REPLAY
        engine = self.engine
        assert engine is not None  # engine ranks only (the role was checked at construction)

        def consume(bucket: Bucket) -> None:
            r.run.where = f"bucket {bucket.index}"
            if keep:  # our own buffer, kept until the next refit succeeds: the engine may stage views
                bucket = attrs.evolve(bucket, retained=True)
            engine.load_bucket(bucket)
            r.next_index, r.run.tensors = bucket.index + 1, r.run.tensors + len(bucket.metas)
            if keep:  # received into a buffer of our own: kept for a replay if a later step fails
                r.incoming.append(bucket)

        try:
            stats = self.comm.transport(source, r.run.refit_id).receive(consume, self._pool.take if keep else None)
            r.run.buckets += stats.buckets
            r.run.bytes_sent += stats.payload_bytes
            r.run.add_times({"stream": stats.seconds, "wire": stats.blocked_seconds, "load": stats.consume_seconds})
        except (CollectiveTimeout, PeerLost):
            raise
        except Exception as err:
            r.fail(r.run.where if r.run.where.startswith("bucket") else f"bucket {r.next_index}", err)

    def _finalize(self, r: _Rank) -> None:
        if self.engine is None or r.before is None:
            return
        try:
            commit_engine(self.engine, r.run, r.before)
        except Exception as err:
            r.fail(r.run.where, err)

    # --- endings ---------------------------------------------------------------------------

    def _settle(self, r: _Rank) -> None:
        """After a failure anywhere: leave this engine with its previous weights, or stale."""
        if self.engine is None:
            return
        self._pool.give(r.incoming)  # this refit's bytes will not be replayed
        r.incoming = []
        reason = f"refit {r.run.refit_id} failed ({r.status.error or 'on another rank'})"
        state = settle_engine(self.engine, r.run, reason, lambda engine, _run, why: self._replay_previous(engine, r, why))
        r.status = attrs.evolve(r.status, engine=state)

    def _replay_previous(self, engine: RolloutEngine, r: _Rank, reason: str) -> EngineState | None:
        """Bring back the previous refit's weights by replaying its buckets; None: cannot (stale)."""
        if self.restore_policy is Restore.STALE or self._replay is None:
            return None
        try:
            engine.begin_refit(r.run.refit_id)
            for bucket in self._replay:
                engine.load_bucket(bucket)
            engine.finalize_refit()
        except Exception as err:
            engine.abort_refit(f"replay failed: {err}")
            engine.mark_stale(f"{reason}; replaying the previous refit failed: {err}")
            return EngineState.STALE
        if r.before is not None and r.before.differences(engine.storage_fingerprint()):
            engine.mark_stale(f"{reason}; the replay rebound captured storage")
            return EngineState.STALE
        return EngineState.RESTORED

    def _succeeded(self, r: _Rank) -> RefitReport:
        r.run.live()  # on every rank: the refit is live on every engine
        if self.engine is not None and self.restore_policy is Restore.REPLAY:
            self._pool.give(self._replay or [])
            self._replay, r.incoming = r.incoming, []
        report = r.run.report()
        self.reports.append(report)
        log.info("distributed refit", rank=self.rank, role=self.role.value, **report.log_fields())
        return report


def _numbered(exporter: ShardExporter, buckets: Iterable[Bucket], offset: int, final: bool) -> Iterator[Bucket]:
    """A source's buckets, numbered from `offset` in the whole refit; only the final source's last
    bucket is the refit's last."""
    for b in buckets:
        index = b.index + offset
        exporter.where = f"bucket {index}"
        yield attrs.evolve(b, index=index, is_last=b.is_last and final)


def _counted(run: RefitRun, buckets: Iterable[Bucket]) -> Iterator[Bucket]:
    for b in buckets:
        run.tensors += len(b.metas)
        yield b
