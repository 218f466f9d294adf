"""One refit as a service runs it, on one process or one rank: its lifecycle, timings and outcome.

Both refit services (single-process and distributed) keep a RefitRun per refit. It moves through
the session's transition table (IDLE -> STAGING -> FINALIZING -> LIVE, or -> FAILED), measures
every phase, counts what went through, records what the engine did (began, committed, kept,
restored, stale) as soon as the engine did it, and turns all of that into the RefitReport. The
outcome of a failed refit comes from what the engines did, never from where the lifecycle stood.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

import attrs

from domain.errors import RefitIncomplete, StorageRebound
from domain.refit.buckets import Bucket
from domain.refit.report import EngineFinalizeResult, ProbeCheck, RefitOutcome, RefitReport
from domain.refit.session import RefitEvent, RefitState, move
from domain.refit.status import EngineState, RankStatus
from domain.refit.storage import StorageCheck, StorageFingerprint

T = TypeVar("T")


@attrs.define
class StageClock:
    """Inclusive seconds spent inside each stage of a lazy pipeline (generators feeding each other).

    A stage's inclusive time contains the time of the stages it pulls from; `exclusive` subtracts
    them in pipeline order.
    """

    inclusive: dict[str, float] = attrs.field(factory=dict)

    def timed(self, stage: str, it: Iterable[T]) -> Iterator[T]:
        """`it`, timing how long each item takes to produce (added to `inclusive[stage]`)."""
        it = iter(it)
        self.inclusive.setdefault(stage, 0.0)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                self.inclusive[stage] += time.perf_counter() - t0
                return
            self.inclusive[stage] += time.perf_counter() - t0
            yield item
            del item  # not alive while the next one is produced (a bucket by reference holds its tensors)

    def exclusive(self, order: Sequence[str]) -> dict[str, float]:
        """Seconds of each stage alone, for stages listed from the innermost (the source) out."""
        out, inner = {}, 0.0
        for stage in order:
            total = self.inclusive.get(stage, 0.0)
            out[stage] = max(total - inner, 0.0)
            inner = max(total, inner)
        return out


@attrs.define
class RefitRun:
    """One refit on one side.

    Attributes:
        refit_id: the refit's id.
        plan: the quantization plan, in words.
        bucket_bytes: the bucket capacity.
        commit_mode: the engine's commit mode (None without an engine).
        phases: the service's phases (`total` is always one).
        timings: seconds per phase.
        where: the step in progress, for errors (`begin`, `bucket 3`, `finalize`, ...).
        state: the lifecycle's state (the session's transition table).
        engine: what this side's engine did (NONE without an engine, or before it committed).
        began: the engine began this refit (only then may the service abort it).
        source_bytes: bytes of trainer weights that went into the refit.
        bytes_sent: bytes of bucket payloads sent or received.
        buckets: buckets sent or received.
        tensors: checkpoint tensors in them.
        storage: the captured-storage check.
        peak_staging_bytes: most bytes the engine held staged at once.
        kv_scales_reset: attention layers whose KV-cache scales the engine reset.
        parameters_written: engine parameters the engine reported writing (None: not counted).
        unwritten: engine parameters it reported leaving unwritten.
        probe: the post-refit probe's result (None when not run).
        error: the first failure, in words.
    """

    refit_id: int
    plan: str
    bucket_bytes: int
    commit_mode: str | None
    phases: tuple[str, ...]
    timings: dict[str, float] = attrs.field(init=False)
    where: str = "begin"
    state: RefitState = RefitState.IDLE
    engine: EngineState = EngineState.NONE
    began: bool = False
    source_bytes: int = 0
    bytes_sent: int = 0
    buckets: int = 0
    tensors: int = 0
    storage: StorageCheck = attrs.field(factory=lambda: StorageCheck(checked=False))
    peak_staging_bytes: int = 0
    kv_scales_reset: int = 0
    parameters_written: int | None = None
    unwritten: tuple[str, ...] = ()
    probe: ProbeCheck | None = None
    error: str | None = None
    _t0: float = attrs.field(init=False, factory=time.perf_counter)

    def __attrs_post_init__(self) -> None:
        self.timings = dict.fromkeys((*self.phases, "total"), 0.0)

    # --- lifecycle ---------------------------------------------------------------------------

    def _move(self, event: RefitEvent) -> None:
        self.state = move(self.state, event, self.refit_id)

    def open(self) -> None:
        """The refit starts (IDLE -> STAGING)."""
        self._move(RefitEvent.BEGIN)

    def finalizing(self) -> None:
        """Every bucket is through; the engines finalize (STAGING -> FINALIZING)."""
        self._move(RefitEvent.FINALIZE)

    def live(self) -> None:
        """The refit committed everywhere (FINALIZING -> LIVE)."""
        self._move(RefitEvent.COMMIT)
        if self.engine is not EngineState.NONE:
            self.engine = EngineState.LIVE

    def fail(self, where: str, err: BaseException | str) -> None:
        """Record the first failure and end the lifecycle as FAILED (later calls keep the first)."""
        if self.error is None:
            self.where = where
            self.error = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
        if self.state in (RefitState.STAGING, RefitState.FINALIZING):
            self._move(RefitEvent.FAIL)

    @property
    def failed(self) -> bool:
        return self.error is not None

    # --- measurements --------------------------------------------------------------------------

    @contextlib.contextmanager
    def phase(self, name: str, where: str | None = None) -> Iterator[None]:
        """Time a phase (added to `timings[name]`) and name the step in progress."""
        self.where = where or name
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t0

    def add_times(self, times: dict[str, float]) -> None:
        for name, seconds in times.items():
            self.timings[name] = self.timings.get(name, 0.0) + seconds

    def count(self, bucket: Bucket) -> None:
        """A bucket went through."""
        self.buckets += 1
        self.bytes_sent += bucket.payload_bytes
        self.tensors += len(bucket.metas)

    # --- what the engine did -------------------------------------------------------------------

    def committed(self, result: EngineFinalizeResult) -> None:
        """The engine's finalize returned: its live weights hold this refit. Recorded before any
        later step can fail, so that a failure afterwards restores or marks it stale."""
        self.engine = EngineState.COMMITTED
        self.peak_staging_bytes = result.peak_staging_bytes
        self.kv_scales_reset = result.kv_scales_reset
        self.parameters_written = result.parameters_written
        self.unwritten = tuple(result.unwritten)

    def check_written(self) -> None:
        """After commit: RefitIncomplete when the engine left parameters unwritten."""
        if self.unwritten:
            raise RefitIncomplete(self.refit_id, self.unwritten)

    def check_storage(self, before: StorageFingerprint, after: StorageFingerprint) -> None:
        """The captured-storage check after commit: StorageRebound when a tensor was rebound."""
        changed = tuple(before.differences(after))
        self.storage = StorageCheck(checked=True, changed=changed)
        if changed:
            raise StorageRebound(
                f"refit {self.refit_id}: {len(changed)} captured live tensors changed data pointer, "
                f"shape, stride or dtype (e.g. {list(changed[:3])}); the engine must copy in place"
            )

    # --- the report ----------------------------------------------------------------------------

    def outcome(self, statuses: Sequence[RankStatus] = ()) -> RefitOutcome:
        """LIVE once committed everywhere; after a failure STALE when this engine (or, in a
        distributed refit, any engine) is stale, else ROLLED_BACK."""
        if self.state is RefitState.LIVE:
            return RefitOutcome.LIVE
        if self.engine is EngineState.STALE or any(s.engine is EngineState.STALE for s in statuses):
            return RefitOutcome.STALE
        return RefitOutcome.ROLLED_BACK

    def report(self, error: str | None = None, statuses: Sequence[RankStatus] = ()) -> RefitReport:
        """The RefitReport so far (`total` is the time since the run was created).

        Args:
            error: the failure's message (default: the run's first error).
            statuses: every rank's final status, for a distributed refit's outcome.
        """
        self.timings["total"] = time.perf_counter() - self._t0
        return RefitReport(
            refit_id=self.refit_id, outcome=self.outcome(statuses), plan=self.plan, commit_mode=self.commit_mode,
            source_bytes=self.source_bytes, bytes_sent=self.bytes_sent, buckets=self.buckets, tensors=self.tensors,
            timings=dict(self.timings), peak_staging_bytes=self.peak_staging_bytes, bucket_bytes=self.bucket_bytes,
            storage=self.storage, kv_scales_reset=self.kv_scales_reset,
            error=error if error is not None else self.error, parameters_written=self.parameters_written,
            unwritten=self.unwritten, probe=self.probe, engine_state=self.engine.value,
        )
