"""DistributedRefitService: one refit across trainer and engine processes, failing together.

Every rank of a RefitWorld runs `refit()` at the same time. The ranks agree three times:

1. `begin`: every rank is configured alike (refit id, plan, layout, model) and every engine began;
2. `staged`: every source exported and sent its segment, every engine loaded every bucket;
3. `finalized`: every engine post-processed, verified and committed, with its captured storage
   unchanged; trainers report any failure of theirs in the meantime.

Between 1 and 2 the sources take turns, stage by stage (a turn is a small collective of the
source's TP group and the engines, which also carries the next bucket index and stops later
sources once anything failed). When any rank reports a failure at any agreement, every rank
settles the same refit: engines that had not committed abort it (live weights kept; per-layer
engines that wrote some layers become stale); engines that had committed replay the previous
refit's buckets (kept on the host for that purpose) or mark themselves stale; then a fourth
agreement, `settled`, tells every rank what each engine did and all raise the same
DistributedRefitFailed. A collective that times out (a hung peer) or loses its peer ends the refit
on this rank at once with CollectiveTimeout / PeerLost; the world is unusable afterwards.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

import attrs
import structlog
import torch

from adapters.distributed.wire import LEAD_BYTES, RECEIVE_SLACK
from adapters.memory.faults import RankFault
from app.services.refit import describe_plan
from app.services.shard_export import ShardExporter
from domain.errors import (
    CollectiveTimeout,
    ConfigError,
    DistributedRefitFailed,
    InjectedFault,
    PeerLost,
    RefitLifecycleError,
    StorageRebound,
)
from domain.quant.plan import QuantizationPlan
from domain.refit.buckets import DEFAULT_ALIGNMENT, Bucket, BucketPlanner
from domain.refit.report import RefitOutcome, RefitReport
from domain.refit.session import CommitMode
from domain.refit.sharding import ENGINE, TRAINER, ExportUnit, RefitWorld, ShardMap
from domain.refit.status import EngineState, RankStatus, TransferStats, failure_summary
from domain.refit.storage import StorageCheck, StorageFingerprint
from ports.refit_collectives import RefitCollectives
from ports.rollout_engine import RolloutEngine
from ports.sharded_trainer import ShardedTrainerModel

log = structlog.get_logger()
T = TypeVar("T")
PHASES = ("export", "pack", "stream", "wire", "load", "finalize", "verify", "agree", "total")


@attrs.define
class _Refit:
    """One refit's state on this rank."""

    refit_id: int
    status: RankStatus
    timings: dict[str, float] = attrs.field(factory=lambda: dict.fromkeys(PHASES, 0.0))
    where: str = ""
    next_index: int = 0
    tensors: int = 0
    source_bytes: int = 0
    transfer: TransferStats = attrs.field(factory=TransferStats)
    began: bool = False
    state: EngineState = EngineState.NONE
    before: StorageFingerprint | None = None
    storage: StorageCheck = attrs.field(factory=lambda: StorageCheck(checked=False))
    peak_staging: int = 0
    kv_reset: int = 0
    incoming: list[Bucket] = attrs.field(factory=list)

    def fail(self, step: str, err: BaseException | str) -> None:
        self.status = self.status.failed(step, err)


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
        return torch.empty(max(nbytes, self.capacity) + RECEIVE_SLACK, dtype=torch.uint8)[:nbytes]  # received in place

    def give(self, buckets: Iterable[Bucket]) -> None:
        for b in buckets:  # the whole allocation behind the bucket's view
            self.free.append(torch.empty(0, dtype=torch.uint8).set_(b.buffer.untyped_storage()))


@attrs.define
class DistributedRefitService:
    """This rank's side of a distributed refit.

    Attributes:
        world: the refit world (trainer layout, engine count).
        comm: the collectives (TorchDistCollectives on torch.distributed).
        plan: the rollout quantization plan, the same on every rank.
        shapes: the full model's (name, shape), in layer order (engines need it for the segments).
        trainer: this rank's shards (trainer ranks).
        engine: the rollout engine (engine ranks), a full replica.
        bucket_bytes: bucket capacity.
        alignment: byte alignment in buckets.
        window: buckets in flight per stream (2 = double buffering, 1 = none).
        restore: what an engine that committed does when the refit fails elsewhere: `replay` the
            previous refit's buckets (host memory: one quantized copy of the model) or `stale`;
            None = replay for transactional engines, stale for per-layer ones (bounded memory).
        fault: an injected failure (tests, `refit demo --procs N --inject-fault`).
        hang_s: how long an injected hang sleeps.
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
    restore: str | None = None
    fault: RankFault | None = None
    hang_s: float = 60.0
    reports: list[RefitReport] = attrs.field(factory=list)
    shard_map: ShardMap = attrs.field(init=False)
    _next_id: int = attrs.field(init=False, default=1)
    _refits: int = attrs.field(init=False, default=0)
    _replay: list[Bucket] | None = attrs.field(init=False, default=None)
    _pool: _BufferPool = attrs.field(init=False)
    _planner: BucketPlanner = attrs.field(init=False)
    _broken: str | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        role = self.world.role(self.comm.rank)
        if (role == TRAINER) != (self.trainer is not None) or (role == ENGINE) != (self.engine is not None):
            raise ConfigError("distributed refit", f"rank {self.comm.rank} is a {role} rank: give it a {role} only")
        if self.restore not in (None, "replay", "stale"):
            raise ConfigError("restore", f"{self.restore!r} is not one of replay, stale")
        if self.window not in (1, 2):
            raise ConfigError("window", f"must be 1 (no overlap) or 2 (double buffering), got {self.window}")
        if self.trainer is not None and [tuple(x) for x in self.trainer.weight_shapes()] != [tuple(x) for x in self.shapes]:
            raise ConfigError("distributed refit", f"rank {self.rank}: the trainer's weights differ from the model "
                              "the refit was configured with (names or shapes); give every rank the same model")
        self.shard_map = ShardMap.build(self.world.layout, self.shapes, self.plan)
        self._pool = _BufferPool(self.bucket_bytes)
        # One planner for every refit: its `window` buffers stay allocated (validated sizes, too).
        # Packed buckets leave room for the transport's lead record: one message per bucket.
        self._planner = BucketPlanner(self.bucket_bytes, self.alignment, reuse_buffer=True, buffers=self.window,
                                      lead_bytes=LEAD_BYTES)
        sources = [s for s, _ in self.shard_map.segments()]
        f = self.fault
        if f is not None and f.rank == self.rank and f.point == "bucket" and role == TRAINER and self.rank not in sources:
            raise ConfigError("--fault-rank", f"rank {self.rank} sends no buckets; bucket faults hit a source {sources} or an engine")
        if f is not None and f.rank == self.rank and f.point == "export" and role == ENGINE:
            raise ConfigError("--fault-rank", f"rank {self.rank} is an engine; export faults hit trainer ranks")

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def broken(self) -> str | None:
        """Why the world cannot run more refits (a collective timed out or lost a peer), or None."""
        return self._broken

    @property
    def role(self) -> str:
        return self.world.role(self.rank)

    @property
    def restore_policy(self) -> str:
        if self.restore is not None:
            return self.restore
        mode = self.engine.commit_mode if self.engine is not None else CommitMode.TRANSACTIONAL
        return "replay" if mode is CommitMode.TRANSACTIONAL else "stale"

    def _fingerprint(self, refit_id: int) -> str:
        key = repr((refit_id, self.plan, self.world, tuple(self.shapes), self.bucket_bytes, self.alignment))
        return f"{zlib.crc32(key.encode()):08x}"

    # --- the refit -------------------------------------------------------------------------

    def refit(self) -> RefitReport:
        """Run one refit on this rank, in step with every other rank of the world.

        Returns:
            This rank's RefitReport of a refit that is live on every engine.

        Raises:
            DistributedRefitFailed: any rank failed; `.report` is this rank's report and
                `.statuses` every rank's final status (the same on every rank).
            CollectiveTimeout / PeerLost: a peer hung or vanished; `.report` is attached. The world
                cannot run further refits (nor after any other unexpected error mid-protocol).
        """
        if self._broken is not None:
            raise RefitLifecycleError(f"rank {self.rank}: the refit world is unusable ({self._broken}); restart it")
        refit_id, self._next_id = self._next_id, self._next_id + 1
        r = _Refit(refit_id, RankStatus(self.rank, self.role, fingerprint=self._fingerprint(refit_id)))
        t0 = time.perf_counter()
        try:
            self._begin(r)
            ok = self._agree(r, "begin")
            if ok:
                self._stream(r)
                ok = self._agree(r, "staged")
            if ok:
                self._finalize(r)
                ok = self._agree(r, "finalized")
            if ok:
                return self._succeeded(r, t0)
            self._settle(r)
            statuses = self.comm.agree("settled", r.status)
        except Exception as err:  # a timeout, a lost peer, or a bug: peers' positions are unknown
            self._broken = f"{type(err).__name__} at {getattr(err, 'step', r.where)!r}"
            r.fail(r.where or "collective", err)
            self._settle(r)
            err.report = self._report(r, t0)  # type: ignore[attr-defined]
            log.error("distributed refit", **_fields(err.report, self.rank, self.role))  # type: ignore[attr-defined]
            raise
        finally:
            self._refits += 1
        report = self._report(r, t0, failure_summary(refit_id, statuses), statuses)
        log.error("distributed refit", **_fields(report, self.rank, self.role))
        failure = DistributedRefitFailed(report.error)
        failure.report = report  # type: ignore[attr-defined]
        failure.statuses = statuses  # type: ignore[attr-defined]
        raise failure

    def _agree(self, r: _Refit, step: str) -> bool:
        r.where = f"agreement {step!r}"
        t0 = time.perf_counter()
        statuses = self.comm.agree(step, r.status)
        r.timings["agree"] += time.perf_counter() - t0
        if step == "begin":
            reference = statuses[0].fingerprint
            odd = [s.rank for s in statuses if s.fingerprint != reference]
            if odd and self.rank in odd:
                r.fail("begin", f"configured differently from rank 0 (refit id, plan, layout, model or "
                       f"bucket size differ on ranks {odd}); start every rank with the same settings")
            return not odd and all(s.ok for s in statuses)
        return all(s.ok for s in statuses)

    def _fires(self, point: str, index: int | None = None) -> None:
        """Injected faults this service handles (engine bucket/finalize/verify failures are the
        ScriptedFaultyEngine's, so they fail inside the engine as a real one would)."""
        f = self.fault
        if f is None or not f.hits(self.rank, self._refits, point, index):
            return
        if self.role == ENGINE and not f.hang and point != "begin":
            return
        if f.hang:
            time.sleep(self.hang_s)
        raise InjectedFault(f"injected fault ({f}) on rank {self.rank}")

    def _begin(self, r: _Refit) -> None:
        r.where = "begin"
        try:
            self._fires("begin")
            if self.engine is not None:
                r.before = self.engine.storage_fingerprint()
                self.engine.begin_refit(r.refit_id)
                r.began = True
        except Exception as err:
            r.fail("begin", err)

    def _stream(self, r: _Refit) -> None:
        segments = self.shard_map.segments()
        layout = self.world.layout
        for source, units in segments:
            c = layout.coords(source)
            tp = layout.tp_ranks(c.stage, c.ep_rank)
            if self.rank not in tp and self.role != ENGINE:
                continue
            r.where = f"turn of rank {source}"
            t0 = time.perf_counter()
            failed, offset = self.comm.turn(source, r.where, not r.status.ok, r.next_index)
            r.timings["agree"] += time.perf_counter() - t0
            if failed:
                continue  # a rank already failed: nobody sends more
            if self.rank == source:
                self._send(r, units, offset, final=source == segments[-1][0])
            elif self.rank in tp:
                self._serve(r, source, units)
            else:
                self._receive(r, source)

    def _exporter(self) -> ShardExporter:
        def on_unit(_unit: ExportUnit, i: int) -> None:
            self._fires("export", i)

        return ShardExporter(self.plan, self.shard_map, self.trainer, self.comm, on_unit)  # type: ignore[arg-type]

    def _send(self, r: _Refit, units: Sequence[ExportUnit], offset: int, final: bool) -> None:
        exporter = self._exporter()
        gen = exporter.stream(units)
        clock = {"export": 0.0, "pack": 0.0}
        packed = self._planner.pack(_timed(clock, "export", gen))
        buckets = self._numbered(exporter, _timed(clock, "pack", packed), offset, final)
        try:
            r.transfer = self.comm.transport(self.rank, r.refit_id).send(_counted(r, buckets))
        except (CollectiveTimeout, PeerLost):
            raise
        except Exception as err:
            r.fail(exporter.where, err)
        finally:
            gen.close()  # an unfinished export tells its TP peers to stop
            r.source_bytes += exporter.source_bytes
            r.timings["export"] += clock["export"]
            r.timings["pack"] += max(clock["pack"] - clock["export"], 0.0)
            r.timings["stream"] += r.transfer.seconds
            r.timings["wire"] += r.transfer.blocked_seconds

    def _numbered(self, exporter: ShardExporter, buckets: Iterable[Bucket], offset: int, final: bool) -> Iterator[Bucket]:
        for b in buckets:
            index = b.index + offset
            exporter.where = f"bucket {index}"
            self._fires("bucket", index)
            yield attrs.evolve(b, index=index, is_last=b.is_last and final)

    def _serve(self, r: _Refit, source: int, units: Sequence[ExportUnit]) -> None:
        exporter = self._exporter()
        t0 = time.perf_counter()
        try:
            exporter.serve(source, units)
        except (CollectiveTimeout, PeerLost):
            raise
        except Exception as err:
            r.fail(exporter.where, err)
        finally:
            r.source_bytes += exporter.source_bytes
            r.timings["export"] += time.perf_counter() - t0

    def _receive(self, r: _Refit, source: int) -> None:
        keep = self.restore_policy == "replay"

        def consume(bucket: Bucket) -> None:
            r.where = f"bucket {bucket.index}"
            self._fires("bucket", bucket.index)
            if keep:  # our own buffer, kept until the next refit succeeds: the engine may stage views
                bucket = attrs.evolve(bucket, retained=True)
            self.engine.load_bucket(bucket)  # type: ignore[union-attr]
            r.next_index, r.tensors = bucket.index + 1, r.tensors + len(bucket.metas)
            if keep:  # received into a buffer of our own: kept for a replay if a later step fails
                r.incoming.append(bucket)

        try:
            stats = self.comm.transport(source, r.refit_id).receive(consume, self._pool.take if keep else None)
            r.transfer = attrs.evolve(stats, buckets=r.transfer.buckets + stats.buckets,
                                      payload_bytes=r.transfer.payload_bytes + stats.payload_bytes)
            r.timings["stream"] += stats.seconds
            r.timings["wire"] += stats.blocked_seconds
            r.timings["load"] += stats.consume_seconds
        except (CollectiveTimeout, PeerLost):
            raise
        except Exception as err:
            r.fail(r.where or f"bucket {r.next_index}", err)

    def _finalize(self, r: _Refit) -> None:
        try:
            r.where = "finalize"
            self._fires("finalize")
            if self.engine is None:
                self._fires("verify")
                return
            t0 = time.perf_counter()
            result = self.engine.finalize_refit()
            r.timings["finalize"] = time.perf_counter() - t0
            r.peak_staging, r.kv_reset = result.peak_staging_bytes, result.kv_scales_reset
            r.where = "verify"
            self._fires("verify")
            t0 = time.perf_counter()
            changed = tuple(r.before.differences(self.engine.storage_fingerprint()))  # type: ignore[union-attr]
            r.storage = StorageCheck(checked=True, changed=changed)
            r.timings["verify"] = time.perf_counter() - t0
            if changed:
                reason = f"{len(changed)} captured live tensors were rebound (e.g. {list(changed[:3])})"
                self.engine.mark_stale(reason)
                raise StorageRebound(f"refit {r.refit_id}: {reason}; the engine must copy in place")
            r.state = EngineState.COMMITTED
        except Exception as err:
            r.fail(r.where, err)

    # --- endings ---------------------------------------------------------------------------

    def _settle(self, r: _Refit) -> None:
        """After a failure anywhere: leave this engine with its previous weights, or stale."""
        if self.engine is None:
            return
        self._pool.give(r.incoming)  # this refit's bytes will not be replayed
        r.incoming = []
        reason = f"refit {r.refit_id} failed ({r.status.error or 'on another rank'})"
        if r.state is EngineState.COMMITTED:
            r.state = self._restore(r, reason)
        else:
            if r.began:
                self.engine.abort_refit(reason)  # a no-op when the engine already dropped it
            r.state = EngineState.STALE if self.engine.is_stale else EngineState.KEPT
        r.status = attrs.evolve(r.status, engine=r.state)

    def _restore(self, r: _Refit, reason: str) -> EngineState:
        engine = self.engine
        if engine is None:
            return EngineState.NONE
        if self.restore_policy == "stale" or self._replay is None:
            engine.mark_stale(reason)
            return EngineState.STALE
        try:
            engine.begin_refit(r.refit_id)
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

    def _succeeded(self, r: _Refit, t0: float) -> RefitReport:
        r.state = EngineState.LIVE  # on every rank: the refit is live on every engine
        if self.engine is not None and self.restore_policy == "replay":
            self._pool.give(self._replay or [])
            self._replay, r.incoming = r.incoming, []
        report = self._report(r, t0)
        self.reports.append(report)
        log.info("distributed refit", **_fields(report, self.rank, self.role))
        return report

    def _report(self, r: _Refit, t0: float, error: str | None = None,
                statuses: Sequence[RankStatus] = ()) -> RefitReport:
        r.timings["total"] = time.perf_counter() - t0
        if r.state is EngineState.LIVE:
            outcome = RefitOutcome.LIVE
        elif r.state is EngineState.STALE or any(s.engine is EngineState.STALE for s in statuses):
            outcome = RefitOutcome.STALE
        else:
            outcome = RefitOutcome.ROLLED_BACK
        if error is None and not r.status.ok:
            error = f"refit {r.refit_id} failed on rank {self.rank} at {r.status.step}: {r.status.error}"
        report = RefitReport(
            refit_id=r.refit_id, outcome=outcome, plan=describe_plan(self.plan),
            commit_mode=self.engine.commit_mode.value if self.engine is not None else None,
            source_bytes=r.source_bytes, bytes_sent=r.transfer.payload_bytes, buckets=r.transfer.buckets,
            tensors=r.tensors, timings=dict(r.timings), peak_staging_bytes=r.peak_staging,
            bucket_bytes=self.bucket_bytes, storage=r.storage, kv_scales_reset=r.kv_reset, error=error,
        )
        if outcome is not RefitOutcome.LIVE:
            self.reports.append(report)
        return report


def _counted(r: _Refit, buckets: Iterable[Bucket]) -> Iterator[Bucket]:
    for b in buckets:
        r.tensors += len(b.metas)
        yield b


def _timed(clock: dict[str, float], key: str, it: Iterable[T]) -> Iterator[T]:
    """Inclusive seconds spent producing each item of a lazy stage."""
    it = iter(it)
    while True:
        t0 = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            clock[key] += time.perf_counter() - t0
            return
        clock[key] += time.perf_counter() - t0
        yield item


def _fields(r: RefitReport, rank: int, role: str) -> dict[str, object]:
    return {
        "rank": rank, "role": role, "refit_id": r.refit_id, "outcome": r.outcome.value, "buckets": r.buckets,
        "tensors": r.tensors, "mb": round(r.bytes_sent / 2**20, 3), "seconds": round(r.timings.get("total", 0.0), 4),
        "error": r.error,
    }
