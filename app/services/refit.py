"""RefitService: trainer weights -> quantized checkpoint tensors -> buckets -> engine lifecycle.

One call to `refit()` runs a whole refit in this process, in one RefitTransaction
(app.services.transaction, `with transaction(...) as tx:`) with the agreement of a single side:
entering it opens the refit on the engine, the block streams the trainer's weights through the
quantizer and the bucket planner into the engine, and leaving it finalizes once, audits what the engine wrote, checks that no captured live tensor was rebound,
runs the post-refit probe, and returns the RefitReport. On any failure the engine is settled (it
keeps its previous weights, is restored from the previous refit's buckets, or is marked stale)
and RefitFailed carries the report. One canonical log line per refit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import attrs
import structlog
import torch

from app.services.codec_path import CodecPathChoice, choose_codec_path, on_path
from app.services.transaction import (
    Ownership,
    RefitTransaction,
    ReplayCopy,
    Restore,
    describe_plan,
    transaction,
)
from app.services.verification import PostRefitProbe
from domain.errors import ConfigError, DeltaBaseMismatch, RefitFailed
from domain.quant.plan import QuantizationPlan
from domain.quant.stream import quantize_stream
from domain.refit.buckets import DEFAULT_ALIGNMENT, BucketPlanner
from domain.refit.delta_sync import DeltaBase, DeltaSender
from domain.refit.report import RefitReport
from domain.refit.run import RefitRun, StageClock
from ports.delta_engine import DeltaEngine
from ports.rollout_engine import RolloutEngine
from ports.trainer_model import TrainerModel

PHASES = ("export", "quantize", "pack", "load", "finalize", "verify", "total")
# Progress of a refit: (source bytes exported so far, total source bytes).
Progress = Callable[[int, int], None]


@attrs.define
class RefitService:
    """Drives refits from a trainer into a rollout engine.

    Attributes:
        trainer: the TrainerModel whose weights are sent.
        engine: the RolloutEngine that receives them.
        plan: the rollout quantization plan (BF16 = send the weights as they are).
        bucket_bytes: capacity of one bucket.
        alignment: byte alignment of every tensor in a bucket.
        ownership: who owns the buckets' memory. BY_REFERENCE (the engine lives in this process):
            hand it the exported tensors themselves, grouped into buckets but never packed
            (retained until the refit ends); an engine that stages by reference then copies each
            byte once, into its live tensors. REUSED: pack every bucket into one sender buffer
            (memory: one bucket), for an engine whose transport copies the bytes out (an engine in
            processes of its own). OWNED: a buffer per bucket, valid until the refit ends.
        restore: what brings the engine back when a refit fails after it lost its weights; None:
            `Restore.default` (the engine's own backup for transactional engines, stale for
            per-layer ones). REPLAY keeps the last live refit's buckets on the host.
        progress: called after every bucket with (source bytes so far, total), e.g. a progress
            bar the CLI draws; None: nothing is reported.
        probe: the post-refit probe (the engine's log-probs against a reference after each
            commit; a mismatch fails the refit and leaves the engine stale); None: not run.
        delta: the delta sender of a `layout_delta` refit (the engine must be a DeltaEngine);
            None: every refit sends every tensor whole.
        codec_path: auto (before the first refit, outside its timings, choose the native, else
            the compiled codec path where it is bit-identical to the eager one on the model and
            faster: app.services.codec_path) or eager.
        native_codecs: builds and installs the native codec kernels, returning None or why not
            (the composition root's); None: the native path is not tried.
        reports: every refit's report, oldest first.
    """

    trainer: TrainerModel
    engine: RolloutEngine
    plan: QuantizationPlan = attrs.field(factory=QuantizationPlan.bf16)
    bucket_bytes: int = 64 << 20
    alignment: int = DEFAULT_ALIGNMENT
    ownership: Ownership = attrs.field(default=Ownership.BY_REFERENCE, converter=Ownership)
    restore: Restore | None = attrs.field(default=None, converter=attrs.converters.optional(Restore))
    progress: Progress | None = None
    probe: PostRefitProbe | None = None
    delta: DeltaSender | None = None
    codec_path: str = "auto"
    native_codecs: Callable[[], str | None] | None = None
    reports: list[RefitReport] = attrs.field(factory=list)
    _codec: CodecPathChoice | None = attrs.field(init=False, default=None)
    _next_id: int = attrs.field(init=False, default=1)
    _replay: ReplayCopy | None = attrs.field(init=False, default=None)
    _planner: tuple[tuple[object, ...], BucketPlanner] | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self._bucket_planner()  # validate the sizes now, not mid-refit
        if self.restore is not None:
            self.restore.check(self.engine.commit_mode)
        if self.delta is not None:
            key = "rollout.checkpoint_engine.backend"
            if not isinstance(self.engine, DeltaEngine):
                raise ConfigError(key, f"layout_delta needs an engine with a delta receiver (ports.delta_engine); "
                                  f"{type(self.engine).__name__} has none: use 'naive'")
            if self.restore_policy is Restore.REPLAY:  # the previous refit's records need the dropped copies
                raise ConfigError(key, "layout_delta cannot restore by replaying the previous refit's buckets "
                                  "(they hold deltas); use rollout.checkpoint_engine.restore: engine or stale")

    def codec_choice(self) -> CodecPathChoice:
        """The codec path this service's refits quantize with, chosen on the first call."""
        if self._codec is None:
            self._codec = choose_codec_path(self.plan, self.trainer, self.codec_path, native=self.native_codecs)
            structlog.get_logger().info("codec path", path=self._codec.path.value, reason=self._codec.reason,
                                        warmup_s=round(self._codec.warmup_seconds, 3))
        return self._codec

    @property
    def restore_policy(self) -> Restore:
        """The restore in force (the configured one, or the default for the engine's commit mode)."""
        return self.restore if self.restore is not None else Restore.default(self.engine.commit_mode, self.ownership)

    def refit(self) -> RefitReport:
        """Run one full refit.

        A delta refit that the engine refuses because its copy does not take a record (the copy
        was corrupted or lost: DeltaBaseMismatch) is settled like any failed refit, then sent again
        whole within this call; its report says so (`delta.why_full`), and `reports` holds both.

        Returns:
            The RefitReport of a refit that is LIVE (committed, audited, storage-checked, probed).

        Raises:
            RefitFailed: carrying the report (outcome ROLLED_BACK or STALE), the cause chained.
        """
        self.codec_choice()  # outside the refit's timings
        try:
            return self._attempt()
        except RefitFailed as failed:
            if self.delta is None or not _delta_refused(failed):
                raise
            why = (f"the engine refused refit {failed.report.refit_id}'s delta ({failed.report.error}); "
                   f"the same refit sent whole")
            structlog.get_logger().warning("delta refused; refit sent whole", refit_id=failed.report.refit_id,
                                           error=failed.report.error)
            self.delta.discard(failed.report.error or "", why_full=why)
        return self._attempt()

    def _attempt(self) -> RefitReport:
        refit_id, self._next_id = self._next_id, self._next_id + 1
        if self.delta is not None:  # full or delta, from the engine's copy (asked before it begins)
            self.delta.begin(self._delta_base())
        with self._transaction(refit_id) as tx:
            clock = StageClock()
            try:
                if tx.begun:
                    self._stream(tx, clock)
            finally:
                tx.run.add_times(clock.exclusive(self._stages()))
        return tx.result

    def _transaction(self, refit_id: int) -> RefitTransaction:
        restore = self.restore_policy
        if restore is Restore.REPLAY and self._replay is None:
            self._replay = ReplayCopy.for_buckets(self.bucket_bytes)
        run = RefitRun(refit_id, describe_plan(self.plan), self.bucket_bytes, self.engine.commit_mode.value, PHASES)
        return transaction(self.engine, run, self.plan, restore=restore,
                           replay=self._replay if restore is Restore.REPLAY else None, probe=self.probe,
                           finish=self._finished)

    def _finished(self, tx: RefitTransaction, report: RefitReport) -> RefitReport:
        """A refit's report as this service hands it out: the delta sender learns the outcome, the
        report gets the codec path and delta figures, is kept and logged (one line per refit)."""
        if self.delta is not None:
            if report.ok:
                self.delta.commit()
            else:
                self.delta.discard(tx.run.error or "")
        report = self._annotated(report)
        self.reports.append(report)
        log = structlog.get_logger().bind(refit_id=report.refit_id, plan=describe_plan(self.plan))
        (log.info if report.ok else log.error)("refit", **report.log_fields())
        return report

    def _stream(self, tx: RefitTransaction, clock: StageClock) -> None:
        run = tx.run
        run.where = "export"
        total = self._total_bytes()
        exported = clock.timed("export", self._counted(run, self.trainer.named_weights()))
        quantized = clock.timed("quantize", on_path(self.codec_choice().path, quantize_stream(self.plan, exported)))
        if self.delta is not None:
            quantized = clock.timed("delta", self.delta.stage(quantized))
        for bucket in clock.timed("pack", self._bucket_planner().pack(quantized)):
            tx.load(bucket, owned=self.ownership is Ownership.OWNED)
            if self.progress is not None:
                self.progress(run.source_bytes, total)
            del bucket  # the engine keeps what it needs; the next bucket is built without this one

    def _bucket_planner(self) -> BucketPlanner:
        """One planner for every refit while the settings stay (its reused buffers stay allocated)."""
        key = (self.ownership, self.bucket_bytes, self.alignment)
        if self._planner is None or self._planner[0] != key:
            self._planner = (key, self.ownership.planner(self.bucket_bytes, self.alignment))
        return self._planner[1]

    @staticmethod
    def _counted(run: RefitRun, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in named:
            run.source_bytes += t.numel() * t.element_size()
            yield name, t

    def _stages(self) -> tuple[str, ...]:
        return ("export", "quantize", "delta", "pack") if self.delta is not None else ("export", "quantize", "pack")

    def _delta_base(self) -> DeltaBase:
        """The engine's delta copy; an engine that cannot say gets a full refit."""
        try:
            return self.engine.delta_base()  # type: ignore[attr-defined]
        except Exception as err:
            structlog.get_logger().warning("the engine's delta base is unknown; a full refit",
                                           error=f"{type(err).__name__}: {err}")
            return DeltaBase()

    def _annotated(self, report: RefitReport) -> RefitReport:
        report = attrs.evolve(report, codec_path=self.codec_choice().path.value)
        if self.delta is None:
            return report
        return attrs.evolve(report, delta=self.delta.report(self._delta_base()))

    def _total_bytes(self) -> int:
        num_bytes = getattr(self.trainer, "num_bytes", None)
        return int(num_bytes()) if callable(num_bytes) else 0


def _delta_refused(failed: RefitFailed) -> bool:
    """Whether a failed refit sent deltas that the engine's copy did not take (DeltaBaseMismatch in
    the cause chain): a refit that then goes whole can succeed."""
    report = failed.report
    if report.delta is None or report.delta.mode != "delta":
        return False
    err: BaseException | None = failed
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, DeltaBaseMismatch):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False
