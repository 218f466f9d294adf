"""DistributedRefitService: one refit across trainer and engine processes, failing together.

Every rank of a RefitWorld runs `refit()` at the same time. The ranks agree three times:

1. `begin`: every rank is configured alike (refit id, plan, layout, model) and every engine began;
2. `staged`: every source exported and sent its segment, every engine loaded every bucket;
3. `finalized`: every engine post-processed, committed and passed its storage check; trainers
   report any failure of theirs in the meantime.

Between 1 and 2 the sources take turns, stage by stage (a turn is a small collective of the
source's TP group and the engines, which also carries the next bucket index and stops later
sources once anything failed). When any rank reports a failure at any agreement, every rank
settles the same refit (app.services.transaction): engines that had not committed abort it (live
weights kept; per-layer engines that wrote some layers become stale); engines that had committed
replay the previous refit's buckets (kept on the host for that purpose) or mark themselves
stale; then a fourth agreement, `settled`, tells every rank what each engine did and all raise the
same DistributedRefitFailed. Each rank's side is one RefitTransaction (app.services.transaction,
`with transaction(...) as tx:`) whose agreement is the world's collectives (`World`): begin,
commit, the probe, the audit, settling and the report are the single-process refit's own. A collective that times out (a hung peer) or loses its peer ends the
refit on this rank at once with CollectiveTimeout / PeerLost; the world is unusable afterwards.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator, Sequence

import attrs
import structlog

from app.services.shard_export import ShardExporter
from app.services.transaction import (
    WORLD_BROKEN,
    Ownership,
    RefitTransaction,
    ReplayCopy,
    Restore,
    World,
    describe_plan,
    transaction,
)
from app.services.verification import PostRefitProbe
from domain.errors import ConfigError, RefitLifecycleError
from domain.quant.plan import QuantizationPlan
from domain.refit.buckets import DEFAULT_ALIGNMENT, Bucket, BucketPlanner
from domain.refit.report import RefitReport
from domain.refit.run import RefitRun, StageClock
from domain.refit.session import CommitMode
from domain.refit.shard_map import ExportUnit, ShardMap
from domain.refit.status import RankStatus, Role
from domain.refit.topology import RefitWorld
from ports.refit_collectives import RefitCollectives
from ports.rollout_engine import RolloutEngine
from ports.sharded_trainer import ShardedTrainerModel

log = structlog.get_logger()
PHASES = ("export", "pack", "stream", "wire", "load", "finalize", "verify", "agree", "total")

__all__ = ["DistributedRefitService", "Restore"]


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
        restore: what an engine that lost its weights does when the refit fails; None:
            `Restore.default` for the engine's commit mode with owned receive buffers (replay for
            transactional engines, stale for per-layer ones: bounded memory).
        probe: engine ranks: the post-refit probe, run after the engine committed (None: not run).
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
    probe: PostRefitProbe | None = None
    reports: list[RefitReport] = attrs.field(factory=list)
    shard_map: ShardMap = attrs.field(init=False)
    _next_id: int = attrs.field(init=False, default=1)
    _replay: ReplayCopy = attrs.field(init=False)
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
        if self.restore is not None and self.engine is not None:
            self.restore.check(self.engine.commit_mode)
        self.shard_map = ShardMap.build(self.world.layout, self.shapes, self.plan)
        self._replay = ReplayCopy.for_buckets(self.bucket_bytes)
        # One planner for every refit: its `window` buffers stay allocated (validated sizes, too).
        # Packed buckets leave the room the transport asks for in front (its lead record: one
        # message per bucket). The transport copies each bucket out before its buffer is reused.
        self._planner = Ownership.REUSED.planner(self.bucket_bytes, self.alignment, window=self.window,
                                                 lead_bytes=self.comm.lead_bytes, device=self.comm.bucket_device)

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
        return Restore.default(mode, Ownership.OWNED)  # receivers keep their own buffers

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
        tx = self._transaction(refit_id)
        try:
            with tx:
                if tx.begun:
                    self._stream(tx)
        finally:  # a timeout, a lost peer, or a bug: peers' positions are unknown
            self._broken = tx.broken
        return tx.result

    def _finished(self, tx: RefitTransaction, report: RefitReport) -> RefitReport:
        """This rank's report as the service hands it out: sided, kept and logged (one line)."""
        report = self._sided(report)
        self.reports.append(report)
        (log.info if report.ok else log.error)("distributed refit", rank=self.rank, role=self.role.value,
                                               **report.log_fields())
        return report

    def _sided(self, report: RefitReport) -> RefitReport:
        """A trainer rank's report says which codec path it quantized with: the eager reference
        (only the single-process service chooses the compiled path, app.services.codec_path)."""
        return attrs.evolve(report, codec_path="eager") if self.role is Role.TRAINER else report

    def _transaction(self, refit_id: int) -> RefitTransaction:
        commit_mode = self.engine.commit_mode.value if self.engine is not None else None
        run = RefitRun(refit_id, describe_plan(self.plan), self.bucket_bytes, commit_mode, PHASES)
        status = RankStatus(self.rank, self.role.value, fingerprint=self._fingerprint(refit_id))
        restore = self.restore_policy
        replay = self._replay if restore is Restore.REPLAY and self.engine is not None else None
        return transaction(self.engine, run, self.plan, status=status, agreement=World(self.comm), restore=restore,
                           replay=replay, probe=self.probe if self.engine is not None else None,
                           finish=self._finished)

    def _stream(self, tx: RefitTransaction) -> None:
        segments = self.shard_map.segments()
        layout = self.world.layout
        next_index = 0
        for source, units in segments:
            c = layout.coords(source)
            tp = layout.tp_ranks(c.stage, c.ep_rank)
            if self.rank not in tp and self.role is not Role.ENGINE:
                continue
            with tx.run.phase("agree", where=f"turn of rank {source}"):
                failed, offset = self.comm.turn(source, tx.run.where, not tx.ok, next_index)
            if failed:
                continue  # a rank already failed: nobody sends more
            if self.rank == source:
                self._send(tx, units, offset, final=source == segments[-1][0])
            elif self.rank in tp:
                self._serve(tx, source, units)
            else:
                next_index = self._receive(tx, source, next_index)

    def _exporter(self) -> ShardExporter:
        assert self.trainer is not None  # trainer ranks only (the role was checked at construction)
        return ShardExporter(self.plan, self.shard_map, self.trainer, self.comm)

    def _send(self, tx: RefitTransaction, units: Sequence[ExportUnit], offset: int, final: bool) -> None:
        exporter = self._exporter()
        gen = exporter.stream(units)
        clock = StageClock()
        packed = self._planner.pack(clock.timed("export", gen))
        buckets = _numbered(exporter, clock.timed("pack", packed), offset, final)
        stats = None
        run = tx.run
        try:
            stats = self.comm.transport(self.rank, run.refit_id).send(_counted(run, buckets))
        except WORLD_BROKEN:
            raise
        except Exception as err:
            tx.fail(exporter.where, err)
        finally:
            gen.close()  # an unfinished export tells its TP peers to stop
            run.source_bytes += exporter.source_bytes
            run.add_times(clock.exclusive(("export", "pack")))
            if stats is not None:
                run.bytes_sent, run.buckets = stats.payload_bytes, stats.buckets
                run.add_times({"stream": stats.seconds, "wire": stats.blocked_seconds})

    def _serve(self, tx: RefitTransaction, source: int, units: Sequence[ExportUnit]) -> None:
        exporter = self._exporter()
        try:
            with tx.run.phase("export"):
                exporter.serve(source, units)
        except WORLD_BROKEN:
            raise
        except Exception as err:
            tx.fail(exporter.where, err)
        finally:
            tx.run.source_bytes += exporter.source_bytes

    def _receive(self, tx: RefitTransaction, source: int, next_index: int) -> int:
        """Receive one source's buckets into the engine; returns the next bucket index."""
        # Kept buckets (a replay copy, on the host) are received in place where the stream runs on
        # the host; a stream on a GPU lands in the transport's buffers and the copy keeps them.
        where = self.comm.bucket_device
        keep = tx.keeps_buckets and (where is None or where.type == "cpu")
        run = tx.run

        def consume(bucket: Bucket) -> None:
            nonlocal next_index
            run.where = f"bucket {bucket.index}"
            tx.load(bucket if not keep else attrs.evolve(bucket, retained=True), owned=keep)
            next_index = bucket.index + 1

        try:
            stats = self.comm.transport(source, run.refit_id).receive(consume, tx.replay.allocate if keep and tx.replay
                                                                     else None)
            run.add_times({"stream": stats.seconds, "wire": stats.blocked_seconds, "load": stats.consume_seconds})
        except WORLD_BROKEN:
            raise
        except Exception as err:
            tx.fail(run.where if run.where.startswith("bucket") else f"bucket {next_index}", err)
        return next_index


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
