"""RefitTransaction: one refit's unit of work, whatever the deployment shape.

Every refit, in one process, across the ranks of a world, or into an engine in processes of its
own, runs the same steps on each side:

    begin  -> stream -> commit (finalize, audit, storage check, probe) -> succeed
        \\________ any failure ________/                                -> settle (restore or stale)

with an agreement after begin, after the stream and after the commit (every side learns whether
every other side got there), and a last one after settling (every side learns what every engine
did). Three strategies make the shapes differ, and nothing else:

- the **agreement**: `Alone` (one process: its own word is the verdict) or a world's collectives
  (every rank's word, `RefitCollectives.agree`);
- the **restore** (`Restore`): re-stream the previous refit's buckets (`replay`, a host copy of
  them), the engine's own backup (`engine`: a transactional engine keeps its weights when a refit
  is aborted), or none (`stale`: an engine that lost its weights refuses to serve until a full
  refit succeeds);
- the **bucket ownership** (`Ownership`): buckets by reference (the engine shares the process),
  owned buffers (kept: a receiver's buffers, the replay copy), or one reused buffer (the transport
  copies the bytes out before the next bucket is packed).

The probe, the written-parameter audit, the storage check, progress and the report are the
transaction's, so they behave the same in every shape.

A transaction is a context manager, the unit-of-work pattern: entering it begins the refit (and
agrees); the block streams when every side began (`tx.begun`); leaving the block normally commits
(staged agreement, finalize, audit, storage check, probe, agreement) and the refit goes live
(`tx.result`); any failure, recorded on any side or raised in the block, settles the engine as the
restore says and raises the refit's typed error (RefitFailed, DistributedRefitFailed) carrying the
report. Every service writes the same few lines:

    with transaction(engine, run, plan, ...) as tx:
        if tx.begun:
            stream(tx)            # tx.load(bucket) for each bucket the engine receives
    return tx.result
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

import attrs
import torch

from app.services.verification import PostRefitProbe, require
from domain.errors import (
    CollectiveTimeout,
    ConfigError,
    DistributedRefitFailed,
    PeerLost,
    RefitFailed,
    RefitLifecycleError,
)
from domain.quant.plan import QuantizationPlan
from domain.refit.buckets import Bucket, BucketPlanner
from domain.refit.report import RefitOutcome, RefitReport
from domain.refit.run import RefitRun
from domain.refit.session import CommitMode
from domain.refit.status import EngineState, RankStatus, Role, failure_summary
from domain.refit.storage import StorageFingerprint
from ports.rollout_engine import RolloutEngine, UndoableEngine

if TYPE_CHECKING:  # a world's collectives: only its agreement holds them
    from ports.refit_collectives import RefitCollectives

# Errors that end a refit on this side at once: a peer hung or vanished, so no later agreement
# can be reached (the world is unusable afterwards).
WORLD_BROKEN = (CollectiveTimeout, PeerLost)


def describe_plan(plan: QuantizationPlan) -> str:
    """A plan in a few words: `linear=FP8_BLOCK moe=NVFP4`."""
    text = f"linear={plan.linear.name} moe={plan.moe.name}"
    if plan.moe_activation is not None:
        text += f" moe_activation={plan.moe_activation.value}"
    return text


class Ownership(enum.Enum):
    """Who owns a bucket's memory, and so how long its bytes stay valid."""

    BY_REFERENCE = "by_reference"  # the exported tensors themselves (engine in this process)
    OWNED = "owned"  # a buffer of the bucket's own, valid until the refit ends (and kept for a replay)
    REUSED = "reused"  # `window` sender buffers, overwritten once the transport copied the bytes out

    def planner(self, bucket_bytes: int, alignment: int, *, window: int = 1, lead_bytes: int = 0,
                device: torch.device | None = None) -> BucketPlanner:
        """The bucket planner of this ownership (validates the sizes); `device`: where packed
        buckets live (None: on their tensors' device)."""
        return BucketPlanner(bucket_bytes, alignment, reuse_buffer=self is Ownership.REUSED,
                             buffers=window if self is Ownership.REUSED else 1, lead_bytes=lead_bytes,
                             by_reference=self is Ownership.BY_REFERENCE, device=device)


class Restore(enum.Enum):
    """What brings an engine back when a refit fails after the engine lost its previous weights
    (it committed, or a per-layer engine had written some layers)."""

    REPLAY = "replay"  # re-stream the previous live refit's buckets (host memory: one quantized copy)
    ENGINE = "engine"  # the engine's own backup: it keeps its weights on abort (transactional engines)
    STALE = "stale"  # nothing: the engine refuses to serve until a full refit succeeds

    @classmethod
    def default(cls, commit_mode: CommitMode, ownership: Ownership) -> Restore:
        """The restore that costs no extra copy: replay when the buckets arrive in owned buffers
        (keeping them is free of copies) and the engine is transactional; otherwise the engine's
        own backup (transactional engines) or stale (per-layer ones, bounded memory)."""
        if commit_mode is CommitMode.TRANSACTIONAL:
            return cls.REPLAY if ownership is Ownership.OWNED else cls.ENGINE
        return cls.STALE

    def check(self, commit_mode: CommitMode) -> None:
        """ConfigError when this restore cannot work with an engine of `commit_mode`."""
        if self is Restore.ENGINE and commit_mode is not CommitMode.TRANSACTIONAL:
            raise ConfigError("restore", f"restore=engine relies on the engine's own backup, but a "
                              f"{commit_mode.value} engine keeps none (it writes its live weights as buckets "
                              "arrive); use restore=replay (a host copy of the previous refit) or restore=stale")


class Agreement(Protocol):
    """How the sides of a refit learn each other's word at an agreement point.

    Attributes:
        peers: other sides wait at the agreements (a world). An exception that escapes a refit's
            block then leaves their positions unknown: this side settles alone and re-raises it.
            Without peers it is one more failure, settled like any other.
    """

    @property
    def peers(self) -> bool: ...

    def agree(self, step: str, status: RankStatus) -> Sequence[RankStatus]:
        """Every side's status at `step`, by rank (this side's included)."""
        ...


@attrs.frozen
class Alone:
    """The agreement of a refit with one side: its own word is the verdict."""

    peers = False

    def agree(self, step: str, status: RankStatus) -> Sequence[RankStatus]:
        return (status,)


@attrs.frozen
class World:
    """The agreement of a world's ranks: every rank's word, through their collectives."""

    collectives: RefitCollectives
    peers = True

    def agree(self, step: str, status: RankStatus) -> Sequence[RankStatus]:
        return self.collectives.agree(step, status)


@attrs.define
class _BufferPool:
    """Buffers a replay copy keeps, recycled from one refit to the next (after the first refits
    the bytes land where they are kept with no allocation)."""

    capacity: int
    free: list[torch.Tensor] = attrs.field(factory=list)

    def take(self, nbytes: int) -> torch.Tensor:
        for i, b in enumerate(self.free):
            if b.numel() >= nbytes:
                return self.free.pop(i)[:nbytes]
        return torch.empty(max(nbytes, self.capacity), dtype=torch.uint8)[:nbytes]

    def give(self, buckets: Iterable[Bucket]) -> None:
        for b in buckets:  # the whole allocation behind the bucket's view
            if b.buffer.numel():
                self.free.append(torch.empty(0, dtype=torch.uint8).set_(b.buffer.untyped_storage()))


@attrs.define
class ReplayCopy:
    """The buckets of the last refit that went live, kept on the host to restore an engine that
    lost its weights (Restore.REPLAY). Lives as long as the service: one per engine side.

    Attributes:
        pool: where kept buckets' buffers come from and return to.
        previous: the last live refit's buckets (None before the first).
    """

    pool: _BufferPool
    previous: list[Bucket] | None = None
    _incoming: list[Bucket] = attrs.field(factory=list)

    @classmethod
    def for_buckets(cls, bucket_bytes: int) -> ReplayCopy:
        return cls(_BufferPool(bucket_bytes))

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A buffer for a bucket that will be kept (a receiver's allocation: no copy later)."""
        return self.pool.take(nbytes)

    def keep(self, bucket: Bucket, owned: bool) -> Bucket:
        """This refit's bucket, kept for a later replay; `owned`: its buffer is already one of
        ours (taken from `allocate`), otherwise its bytes are copied into one."""
        if not owned:
            out = self.pool.take(bucket.nbytes)
            if bucket.by_reference:
                bucket = bucket.packed(out)
            else:  # a reused buffer: its bytes are overwritten by the next bucket
                out.copy_(bucket.buffer[: bucket.nbytes])
                bucket = Bucket(bucket.index, out, bucket.metas, bucket.is_last)
        kept = attrs.evolve(bucket, retained=True)
        self._incoming.append(kept)
        return kept

    def commit(self) -> None:
        """The refit went live: its buckets become the copy a later failure replays."""
        self.pool.give(self.previous or [])
        self.previous, self._incoming = self._incoming, []

    def drop(self) -> None:
        """The refit failed: its buckets will never be replayed."""
        self.pool.give(self._incoming)
        self._incoming = []


def transaction(engine: RolloutEngine | None, run: RefitRun, plan: QuantizationPlan, *,
                status: RankStatus | None = None, agreement: Agreement | None = None,
                restore: Restore = Restore.STALE, replay: ReplayCopy | None = None,
                probe: PostRefitProbe | None = None,
                finish: Callable[[RefitTransaction, RefitReport], RefitReport] | None = None) -> RefitTransaction:
    """One refit's transaction, used as `with transaction(engine, run, plan, ...) as tx:`.

    Args:
        engine: this side's engine (None on a trainer-only side).
        run: the refit's run (its id, plan, bucket size, phases).
        plan: the rollout plan (the probe's bound).
        status: this side's word at the agreements; None: a lone engine side (rank 0).
        agreement: how the sides agree; None: `Alone`.
        restore: what brings the engine back after a failure.
        replay: the replay copy (Restore.REPLAY only).
        probe: the post-refit probe (None: not run).
        finish: the service's hand on every report (annotate, record, log); None: none.

    Returns:
        The RefitTransaction, not begun (entering the `with` block begins it).
    """
    return RefitTransaction(run, status if status is not None else RankStatus(0, Role.ENGINE),
                            agreement if agreement is not None else Alone(), plan, engine, restore, replay, probe,
                            finish)


@attrs.define
class RefitTransaction:
    """One refit on one side (a process, or one rank of a world).

    Attributes:
        run: the refit's run (lifecycle, timings, counts, report).
        status: this side's word at the agreements.
        agreement: how the sides agree (Alone, or the world's collectives).
        plan: the rollout plan (the probe's bound).
        engine: this side's engine (None on a trainer-only side).
        restore: what brings the engine back after a failure.
        replay: the replay copy (Restore.REPLAY only).
        probe: the post-refit probe, run on the engine after it committed (None: not run).
        finish: turns the transaction's report into the one the service hands out (annotates,
            records, logs it), live or failed alike; None: the report as it is.
        statuses: every side's status at the last agreement.
        cause: the first exception this side raised (chained into the refit's error).
        begun: every side began the refit (the begin agreement): the block streams only then.
        broken: why this side could not reach the next agreement (an exception escaped while other
            sides wait: a world is unusable afterwards), or None.
    """

    run: RefitRun
    status: RankStatus
    agreement: Agreement
    plan: QuantizationPlan
    engine: RolloutEngine | None = None
    restore: Restore = Restore.STALE
    replay: ReplayCopy | None = None
    probe: PostRefitProbe | None = None
    finish: Callable[[RefitTransaction, RefitReport], RefitReport] | None = None
    statuses: Sequence[RankStatus] = ()
    cause: BaseException | None = None
    begun: bool = attrs.field(init=False, default=False)
    broken: str | None = attrs.field(init=False, default=None)
    _before: StorageFingerprint | None = attrs.field(init=False, default=None)
    _settled: bool = attrs.field(init=False, default=False)
    _result: RefitReport | None = attrs.field(init=False, default=None)

    # --- the unit of work --------------------------------------------------------------------

    def __enter__(self) -> RefitTransaction:
        """Begin the refit here and on the engine, and agree (`begun`: every side began)."""
        try:
            self.begun = self._begin()
        except BaseException as err:
            self._strand(err)
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Commit (the block ended normally), or settle and raise the refit's typed error."""
        if err is not None:
            if self.agreement.peers or not isinstance(err, Exception) or isinstance(err, WORLD_BROKEN):
                self._strand(err)
                return  # the exception goes on, carrying the report where it has room for one
            self.fail(self.run.where, err)  # alone: one more failure, settled like any other
        try:
            if self._staged() and self._commit():
                report = self._succeed()
            else:
                self._settle(self._reason())
                self._settled_everywhere()
                report = None
        except BaseException as failure:
            self._strand(failure)
            raise
        if report is not None:
            self._result = self._finished(report)
            return
        raise self._failure() from self.cause

    @property
    def result(self) -> RefitReport:
        """The report of a refit that went live (the block left without error)."""
        if self._result is None:
            raise RefitLifecycleError(f"refit {self.run.refit_id} has no result: it is not over, or it failed")
        return self._result

    def _finished(self, report: RefitReport) -> RefitReport:
        return self.finish(self, report) if self.finish is not None else report

    def _reason(self) -> str:
        """Why the engine settles (its abort and stale messages)."""
        if self.agreement.peers:
            return f"refit {self.run.refit_id} failed ({self.status.error or 'on another rank'})"
        return self.run.error or ""

    def _failure(self) -> RefitFailed:
        """The typed error of a refit that failed and settled, carrying the (finished) report."""
        run = self.run
        if self.agreement.peers:
            report = self._finished(self.report(failure_summary(run.refit_id, self.statuses)))
            return DistributedRefitFailed(report.error or "", report=report, statuses=self.statuses)
        state = (
            "it never began on the engine and changed nothing there" if not run.began else
            "the engine is stale and refuses to serve until a full refit succeeds"
            if run.outcome() is RefitOutcome.STALE else
            "the engine's previous weights were restored, bit for bit"
            if run.engine is EngineState.RESTORED else "the engine kept its previous weights, bit for bit"
        )
        report = self._finished(self.report(f"refit {run.refit_id} failed at {run.where} ({run.error}); {state}"))
        return RefitFailed(report.error or "", report=report)

    def _strand(self, err: BaseException) -> None:
        """An exception left this side unable to reach the next agreement (a timeout, a lost peer,
        or a bug while peers wait somewhere unknown): settle here, alone, and give the exception
        this side's report when it has room for one."""
        self.broken = f"{type(err).__name__} at {getattr(err, 'step', self.run.where)!r}"
        self.fail(self.run.where or "collective", err)
        if not self._settled:
            self._settle(f"refit {self.run.refit_id} failed ({self.status.error})")
        report = self._finished(self.run.report())
        if isinstance(err, WORLD_BROKEN):
            err.report = report

    @property
    def ok(self) -> bool:
        return self.status.ok

    @property
    def keeps_buckets(self) -> bool:
        """Buckets are kept for a replay: they must stay valid until the refit ends."""
        return self.replay is not None and self.engine is not None

    def fail(self, step: str, err: BaseException | str) -> None:
        """Record this side's first failure."""
        if isinstance(err, BaseException) and self.cause is None:
            self.cause = err
        self.status = self.status.failed(step, err)
        self.run.fail(step, err)

    @contextlib.contextmanager
    def guard(self, step: str | None = None) -> Iterator[None]:
        """Run a step; a failure is recorded (at `step`, or where the run stood), not raised, so
        that the next agreement tells every side. A broken world is raised at once."""
        try:
            yield
        except WORLD_BROKEN:
            raise
        except Exception as err:
            self.fail(step or self.run.where, err)

    def agree(self, step: str) -> bool:
        """Every side's word at `step`; True when every side is fine."""
        if "agree" in self.run.phases:  # a world's agreements take time worth reporting
            with self.run.phase("agree", where=f"agreement {step!r}"):
                self.statuses = tuple(self.agreement.agree(step, self.status))
        else:
            self.statuses = tuple(self.agreement.agree(step, self.status))
        if step == "begin":
            reference = self.statuses[0].fingerprint
            odd = [s.rank for s in self.statuses if s.fingerprint != reference]
            if odd:
                if self.status.rank in odd:
                    self.fail("begin", f"configured differently from rank {self.statuses[0].rank} (refit id, plan, "
                              f"layout, model or bucket size differ on ranks {odd}); start every rank with the same "
                              "settings")
                return False
        return all(s.ok for s in self.statuses)

    # --- the steps ---------------------------------------------------------------------------

    def _begin(self) -> bool:
        """Open the refit here and on the engine (its storage fingerprint first); agree."""
        self.run.open()
        if self.engine is not None:
            with self.guard("begin"):
                self.run.where = "begin"
                self._before = self.engine.storage_fingerprint()
                self.engine.begin_refit(self.run.refit_id)
                self.run.began = True
        return self.agree("begin")

    def load(self, bucket: Bucket, *, owned: bool = False) -> None:
        """Hand one bucket to the engine (raises: the caller's guard records it).

        Args:
            bucket: the bucket.
            owned: its buffer is one of the replay copy's (`ReplayCopy.allocate`): kept as it is.
        """
        engine = self.engine
        if engine is None:
            raise RuntimeError("load on a side without an engine")
        if self.replay is not None:
            bucket = self.replay.keep(bucket, owned)
        with self.run.phase("load", where=f"bucket {bucket.index}"):
            engine.load_bucket(bucket)  # returns once the engine copied the bucket or kept views
        self.run.count(bucket)  # what this engine loaded, in every shape

    def _staged(self) -> bool:
        """Every source sent its buckets and every engine loaded them: agree."""
        return self.agree("staged")

    def _commit(self) -> bool:
        """Finalize the engine, record the commit, audit what it wrote, check its captured storage,
        run the probe; agree."""
        self.run.finalizing()
        if self.engine is not None and self._before is not None:
            with self.guard():
                self._commit_engine(self.engine, self._before)
        return self.agree("finalized")

    def _commit_engine(self, engine: RolloutEngine, before: StorageFingerprint) -> None:
        with self.run.phase("finalize"):
            result = engine.finalize_refit()
        self.run.committed(result)
        self.run.check_written()
        with self.run.phase("verify", where="storage check"):
            self.run.check_storage(before, engine.storage_fingerprint())
        if self.probe is not None:
            with self.run.phase("verify", where="probe"):
                self.run.probe = self.probe.measure(engine, self.plan)
            require(self.run.probe, self.run.refit_id)

    # --- endings -----------------------------------------------------------------------------

    def _succeed(self) -> RefitReport:
        """The refit is live on every engine: the report; its buckets become the replay copy."""
        self.run.live()
        if self.replay is not None:
            self.replay.commit()
        return self.run.report()

    def _settle(self, reason: str) -> EngineState:
        """After a failure anywhere: leave this side's engine with its previous weights, or stale,
        and say which (also in the status the last agreement carries).

        An engine that had not committed aborts the refit (a transactional engine keeps its
        weights); one that lost its weights (committed, or a per-layer engine that wrote some
        layers) is restored by replaying the previous refit's buckets when the restore is REPLAY,
        and is marked stale otherwise. Runs once per refit.
        """
        self._settled = True
        if self.replay is not None:
            self.replay.drop()
        engine = self.engine
        if engine is None:
            return EngineState.NONE
        if not self.run.began:  # refused at begin (e.g. another thread's refit in progress): it touched nothing
            self.run.engine = EngineState.KEPT
            self.status = attrs.evolve(self.status, engine=EngineState.KEPT)
            return EngineState.KEPT
        if self.run.engine is not EngineState.COMMITTED and self.run.began:
            engine.abort_refit(reason)  # a no-op when the engine already dropped it
        lost = self.run.engine is EngineState.COMMITTED or engine.is_stale
        if not lost:
            state = EngineState.KEPT
        elif self.run.engine is EngineState.COMMITTED and isinstance(engine, UndoableEngine) \
                and engine.undo_commit(reason):
            state = EngineState.RESTORED  # the engine's own backup of the previous refit
        elif self.restore is Restore.REPLAY and self.replay is not None and self.replay.previous is not None:
            state = self._replay_previous(engine, reason)
        else:
            if not engine.is_stale:  # a per-layer engine's abort already said why it is stale
                engine.mark_stale(reason)
            state = EngineState.STALE
        self.run.engine = state
        self.status = attrs.evolve(self.status, engine=state)
        return state

    def _replay_previous(self, engine: RolloutEngine, reason: str) -> EngineState:
        """Bring back the previous refit's weights by re-streaming its buckets."""
        assert self.replay is not None and self.replay.previous is not None  # checked by the caller
        try:
            engine.begin_refit(self.run.refit_id)
            for bucket in self.replay.previous:
                engine.load_bucket(bucket)
            engine.finalize_refit()
        except Exception as err:
            engine.abort_refit(f"replay failed: {err}")
            engine.mark_stale(f"{reason}; replaying the previous refit failed: {err}")
            return EngineState.STALE
        if self._before is not None and self._before.differences(engine.storage_fingerprint()):
            engine.mark_stale(f"{reason}; the replay rebound captured storage")
            return EngineState.STALE
        return EngineState.RESTORED

    def _settled_everywhere(self) -> Sequence[RankStatus]:
        """The last agreement: what every engine did (after `_settle`)."""
        self.statuses = tuple(self.agreement.agree("settled", self.status))
        return self.statuses

    def report(self, error: str | None = None) -> RefitReport:
        """The report so far (a failed refit's, with `error` as its message)."""
        return self.run.report(error, self.statuses if len(self.statuses) > 1 else ())
