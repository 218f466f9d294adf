"""RefitService: trainer weights -> quantized checkpoint tensors -> buckets -> engine lifecycle.

One call to `refit()` runs a whole refit in this process: it opens the refit on the engine,
streams the trainer's weights through the quantizer and the bucket planner into the engine,
finalizes once, checks that no captured live tensor was rebound, and returns the RefitReport. On
any failure the engine is settled (it keeps its previous weights, or is marked stale) and
RefitFailed carries the report. One canonical log line per refit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import attrs
import structlog
import torch

from app.services.lifecycle import begin_engine, commit_engine, describe_plan, settle_engine
from app.services.verification import PostRefitProbe, require
from domain.errors import ConfigError, RefitFailed
from domain.quant.plan import QuantizationPlan
from domain.quant.stream import quantize_stream
from domain.refit.buckets import DEFAULT_ALIGNMENT, BucketPlanner
from domain.refit.delta_sync import DeltaSender
from domain.refit.report import RefitOutcome, RefitReport
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
        reuse_buffer: pack every bucket into one sender buffer (memory: one bucket).
        by_reference: the engine lives in this process: hand it the exported tensors themselves,
            grouped into buckets but never packed (`Bucket.tensors`, retained until the refit
            ends). An engine that stages by reference then copies each byte once, into its live
            tensors; others copy in `load_bucket`. False: pack each bucket into a buffer.
        progress: called after every bucket with (source bytes so far, total), e.g. a progress
            bar the CLI draws; None: nothing is reported.
        probe: the post-refit probe (the engine's log-probs against a reference after each
            commit; a mismatch fails the refit and leaves the engine stale); None: not run.
        delta: the delta sender of a `layout_delta` refit (the engine must be a DeltaEngine);
            None: every refit sends every tensor whole.
        reports: every refit's report, oldest first.
    """

    trainer: TrainerModel
    engine: RolloutEngine
    plan: QuantizationPlan = attrs.field(factory=QuantizationPlan.bf16)
    bucket_bytes: int = 64 << 20
    alignment: int = DEFAULT_ALIGNMENT
    reuse_buffer: bool = True
    by_reference: bool = True
    progress: Progress | None = None
    probe: PostRefitProbe | None = None
    delta: DeltaSender | None = None
    reports: list[RefitReport] = attrs.field(factory=list)
    _next_id: int = attrs.field(init=False, default=1)

    def __attrs_post_init__(self) -> None:
        BucketPlanner(self.bucket_bytes, self.alignment)  # validate the sizes now, not mid-refit
        if self.delta is not None and not isinstance(self.engine, DeltaEngine):
            raise ConfigError("rollout.checkpoint_engine.backend", f"layout_delta needs an engine with a delta "
                              f"receiver (reference, vllm); {type(self.engine).__name__} has none: use 'naive'")

    def refit(self) -> RefitReport:
        """Run one full refit.

        Returns:
            The RefitReport of a refit that is LIVE (committed and storage-checked).

        Raises:
            RefitFailed: carrying the report (outcome ROLLED_BACK or STALE), the cause chained.
        """
        refit_id, self._next_id = self._next_id, self._next_id + 1
        log = structlog.get_logger().bind(refit_id=refit_id, plan=describe_plan(self.plan))
        run = RefitRun(refit_id, describe_plan(self.plan), self.bucket_bytes, self.engine.commit_mode.value, PHASES)
        clock = StageClock()
        try:
            run.open()
            if self.delta is not None:  # full or delta, from the engine's base copy
                self.delta.begin(self.engine.delta_base())  # type: ignore[attr-defined]
            before = begin_engine(self.engine, run)
            self._stream(run, clock)
            run.finalizing()
            commit_engine(self.engine, run, before)
            if self.probe is not None:
                with run.phase("verify", where="probe"):
                    run.probe = self.probe.measure(self.engine, self.plan)
                require(run.probe, refit_id)
            run.live()
            if self.delta is not None:
                self.delta.commit()
        except Exception as err:
            run.add_times(clock.exclusive(self._stages()))
            run.fail(run.where, err)
            if self.delta is not None:
                self.delta.discard(run.error or "")
            settle_engine(self.engine, run, run.error or "")
            report = self._failed(run)
            log.error("refit", **report.log_fields())
            raise RefitFailed(report.error or "", report=report) from err
        run.add_times(clock.exclusive(self._stages()))
        report = self._with_delta(run.report())
        self.reports.append(report)
        log.info("refit", **report.log_fields())
        return report

    def _stream(self, run: RefitRun, clock: StageClock) -> None:
        run.where = "export"
        total = self._total_bytes()
        exported = clock.timed("export", self._counted(run, self.trainer.named_weights()))
        quantized = clock.timed("quantize", quantize_stream(self.plan, exported))
        if self.delta is not None:
            quantized = clock.timed("delta", self.delta.stage(quantized))
        planner = BucketPlanner(self.bucket_bytes, self.alignment, self.reuse_buffer, by_reference=self.by_reference)
        for bucket in clock.timed("pack", planner.pack(quantized)):
            with run.phase("load", where=f"bucket {bucket.index}"):
                self.engine.load_bucket(bucket)  # returns once the engine copied the bucket or kept views
            run.count(bucket)
            if self.progress is not None:
                self.progress(run.source_bytes, total)
            del bucket  # the engine keeps what it needs; the next bucket is built without this one

    @staticmethod
    def _counted(run: RefitRun, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in named:
            run.source_bytes += t.numel() * t.element_size()
            yield name, t

    def _stages(self) -> tuple[str, ...]:
        return ("export", "quantize", "delta", "pack") if self.delta is not None else ("export", "quantize", "pack")

    def _with_delta(self, report: RefitReport) -> RefitReport:
        if self.delta is None:
            return report
        return attrs.evolve(report, delta=self.delta.report(self.engine.delta_base()))  # type: ignore[attr-defined]

    def _total_bytes(self) -> int:
        num_bytes = getattr(self.trainer, "num_bytes", None)
        return int(num_bytes()) if callable(num_bytes) else 0

    def _failed(self, run: RefitRun) -> RefitReport:
        state = (
            "the engine is stale and refuses to serve until a full refit succeeds"
            if run.outcome() is RefitOutcome.STALE else "the engine kept its previous weights, bit for bit"
        )
        report = self._with_delta(run.report(f"refit {run.refit_id} failed at {run.where} ({run.error}); {state}"))
        self.reports.append(report)
        return report
