"""RefitService: trainer weights -> quantized checkpoint tensors -> buckets -> engine lifecycle.

One call to `refit()` runs a whole refit: it opens the session on both sides, streams the
trainer's weights through the quantizer and the bucket planner into the engine, finalizes once,
checks that no captured live tensor was rebound, and returns a RefitReport. On any failure it
aborts the engine (which keeps its previous weights, or marks itself stale) and raises
RefitFailed carrying the report. It logs one canonical line per refit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import attrs
import structlog
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

from domain.errors import RefitFailed, StorageRebound
from domain.quant.plan import QuantizationPlan
from domain.quant.stream import quantize_stream
from domain.refit.buckets import DEFAULT_ALIGNMENT, Bucket, BucketPlanner
from domain.refit.report import RefitOutcome, RefitReport
from domain.refit.session import RefitSession
from domain.refit.storage import StorageCheck
from ports.rollout_engine import RolloutEngine
from ports.trainer_model import TrainerModel

PHASES = ("export", "quantize", "pack", "load", "finalize", "verify", "total")


def describe_plan(plan: QuantizationPlan) -> str:
    """A plan in a few words: `linear=FP8_BLOCK moe=NVFP4`."""
    text = f"linear={plan.linear.name} moe={plan.moe.name}"
    if plan.moe_activation is not None:
        text += f" moe_activation={plan.moe_activation.value}"
    return text


@attrs.define
class _Clock:
    """Inclusive seconds spent inside each stage of the lazy pipeline, and what went through."""

    inclusive: dict[str, float] = attrs.field(factory=dict)
    source_bytes: int = 0

    def timed(self, stage: str, it: Iterable[object]) -> Iterator[object]:
        it = iter(it)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                self.inclusive[stage] = self.inclusive.get(stage, 0.0) + time.perf_counter() - t0
                return
            self.inclusive[stage] = self.inclusive.get(stage, 0.0) + time.perf_counter() - t0
            if stage == "export":
                self.source_bytes += item[1].numel() * item[1].element_size()  # type: ignore[index]
            yield item
            del item  # not alive while the next one is produced (a bucket by reference holds its tensors)

    def exclusive(self) -> dict[str, float]:
        e, q, p = (self.inclusive.get(k, 0.0) for k in ("export", "quantize", "pack"))
        return {"export": e, "quantize": max(q - e, 0.0), "pack": max(p - q, 0.0)}


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
        progress: show a progress bar for refits of at least `progress_min_bytes` source bytes.
        progress_min_bytes: threshold of a "long" refit.
        reports: every refit's report, oldest first.
    """

    trainer: TrainerModel
    engine: RolloutEngine
    plan: QuantizationPlan = attrs.field(factory=QuantizationPlan.bf16)
    bucket_bytes: int = 64 << 20
    alignment: int = DEFAULT_ALIGNMENT
    reuse_buffer: bool = True
    by_reference: bool = True
    progress: bool = False
    progress_min_bytes: int = 256 << 20
    reports: list[RefitReport] = attrs.field(factory=list)
    _next_id: int = attrs.field(init=False, default=1)

    def __attrs_post_init__(self) -> None:
        BucketPlanner(self.bucket_bytes, self.alignment)  # validate the sizes now, not mid-refit

    def refit(self) -> RefitReport:
        """Run one full refit.

        Returns:
            The RefitReport of a refit that is LIVE (committed and storage-checked).

        Raises:
            RefitFailed: with `.report` (outcome ROLLED_BACK or STALE) and the cause chained.
        """
        refit_id, self._next_id = self._next_id, self._next_id + 1
        bound = structlog.get_logger().bind(refit_id=refit_id, plan=describe_plan(self.plan))
        clock = _Clock()
        stats = {"bytes_sent": 0, "buckets": 0, "tensors": 0}
        timings = dict.fromkeys(PHASES, 0.0)
        session = RefitSession()
        storage = StorageCheck(checked=False)
        result = None
        phase = "begin"
        t_start = time.perf_counter()
        try:
            before = self.engine.storage_fingerprint()
            session.begin(refit_id)
            self.engine.begin_refit(refit_id)
            phase = "export"
            exported = clock.timed("export", self.trainer.named_weights())
            quantized = clock.timed("quantize", quantize_stream(self.plan, exported))  # type: ignore[arg-type]
            planner = BucketPlanner(self.bucket_bytes, self.alignment, self.reuse_buffer, by_reference=self.by_reference)
            buckets = clock.timed("pack", planner.pack(quantized))  # type: ignore[arg-type]
            with self._progress_bar() as advance:
                for bucket in buckets:
                    phase = f"bucket {bucket.index}"  # type: ignore[attr-defined]
                    self._send(session, bucket, stats, timings)  # type: ignore[arg-type]
                    advance(clock.source_bytes)
                    del bucket  # the engine keeps what it needs; the next bucket is built without this one
            phase = "finalize"
            t0 = time.perf_counter()
            session.finalize()
            result = self.engine.finalize_refit()
            timings["finalize"] = time.perf_counter() - t0
            phase = "storage check"
            t0 = time.perf_counter()
            changed = tuple(before.differences(self.engine.storage_fingerprint()))
            storage = StorageCheck(checked=True, changed=changed)
            timings["verify"] = time.perf_counter() - t0
            if changed:
                raise StorageRebound(
                    f"refit {refit_id}: {len(changed)} captured live tensors changed data pointer, "
                    f"shape, stride or dtype (e.g. {list(changed[:3])}); the engine must copy in place"
                )
            session.commit()
        except Exception as err:
            timings.update(clock.exclusive())
            timings["total"] = time.perf_counter() - t_start
            report = self._failed(refit_id, err, phase, session, stats, timings, storage, clock.source_bytes)
            bound.error("refit", **_log_fields(report))
            failure = RefitFailed(report.error)
            failure.report = report  # type: ignore[attr-defined]
            raise failure from err
        timings.update(clock.exclusive())
        timings["total"] = time.perf_counter() - t_start
        report = RefitReport(
            refit_id=refit_id, outcome=RefitOutcome.LIVE, plan=describe_plan(self.plan),
            commit_mode=self.engine.commit_mode.value, source_bytes=clock.source_bytes,
            bucket_bytes=self.bucket_bytes, timings=timings, storage=storage,
            peak_staging_bytes=result.peak_staging_bytes, kv_scales_reset=result.kv_scales_reset,
            bytes_sent=stats["bytes_sent"], buckets=stats["buckets"], tensors=stats["tensors"],
        )
        self.reports.append(report)
        bound.info("refit", **_log_fields(report))
        return report

    def _send(self, session: RefitSession, bucket: Bucket, stats: dict[str, int], timings: dict[str, float]) -> None:
        session.accept(bucket)
        t0 = time.perf_counter()
        self.engine.load_bucket(bucket)  # returns once the engine has copied the bucket or kept its views
        timings["load"] += time.perf_counter() - t0
        stats["bytes_sent"] += bucket.payload_bytes
        stats["buckets"] += 1
        stats["tensors"] += len(bucket.metas)

    def _failed(self, refit_id: int, err: Exception, phase: str, session: RefitSession, stats: dict[str, int],
                timings: dict[str, float], storage: StorageCheck, source_bytes: int) -> RefitReport:
        if session.in_progress:
            session.fail()
        reason = f"{type(err).__name__}: {err}"
        if phase != "begin":  # never abort a refit this service did not open
            self.engine.abort_refit(reason)  # a no-op when the engine already dropped the refit
        if isinstance(err, StorageRebound):
            self.engine.mark_stale(reason)  # fail closed: rebound storage is never served
        stale = self.engine.is_stale
        outcome = RefitOutcome.STALE if stale else RefitOutcome.ROLLED_BACK
        state = (
            "the engine is stale and refuses to serve until a full refit succeeds"
            if stale else "the engine kept its previous weights, bit for bit"
        )
        report = RefitReport(
            refit_id=refit_id, outcome=outcome, plan=describe_plan(self.plan),
            commit_mode=self.engine.commit_mode.value, source_bytes=source_bytes,
            bucket_bytes=self.bucket_bytes, timings=timings, storage=storage, peak_staging_bytes=0,
            error=f"refit {refit_id} failed at {phase} ({reason}); {state}",
            bytes_sent=stats["bytes_sent"], buckets=stats["buckets"], tensors=stats["tensors"],
        )
        self.reports.append(report)
        return report

    def _progress_bar(self) -> _ProgressBar:
        total = getattr(self.trainer, "num_bytes", lambda: 0)()
        return _ProgressBar(total if self.progress and total >= self.progress_min_bytes else 0)


class _ProgressBar:
    """A rich progress bar over source bytes, or nothing when `total` is 0."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._progress: Progress | None = None

    def __enter__(self) -> Callable[[int], None]:
        if not self.total:
            return lambda done: None
        self._progress = Progress(TextColumn("refit"), BarColumn(), DownloadColumn(), TimeElapsedColumn(), transient=True)
        self._progress.start()
        task = self._progress.add_task("refit", total=self.total)
        progress = self._progress
        return lambda done: progress.update(task, completed=done)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()


def _log_fields(r: RefitReport) -> dict[str, object]:
    return {
        "outcome": r.outcome.value, "commit_mode": r.commit_mode, "buckets": r.buckets, "tensors": r.tensors,
        "mb_sent": round(r.bytes_sent / 2**20, 3), "mb_source": round(r.source_bytes / 2**20, 3),
        "seconds": round(r.timings.get("total", 0.0), 4), "gbps": round(r.throughput_gbps, 4),
        "peak_staging_mb": round(r.peak_staging_bytes / 2**20, 3), "storage": str(r.storage),
        "kv_scales_reset": r.kv_scales_reset, "error": r.error,
    }

