"""The refit: its session state machine, engine-side results and the captured-storage fingerprint.

A session moves IDLE -> STAGING -> FINALIZING -> LIVE, or -> FAILED (ARCHITECTURE.md section 6).
The moves are an explicit transition table; every other move raises a typed error. Buckets
arrive in order and exactly once; finalize comes once, after the last bucket.
"""

from __future__ import annotations

import enum

import attrs
import torch

from domain.buckets import Bucket
from domain.errors import BucketSequenceError, RefitLifecycleError


class RefitState(enum.Enum):
    IDLE = "idle"  # no refit yet; the engine serves the weights it was built with
    STAGING = "staging"  # buckets are arriving; the engine does not serve
    FINALIZING = "finalizing"  # the last bucket is in; post-processing, verifying, committing
    LIVE = "live"  # the last refit committed; the engine serves it
    FAILED = "failed"  # the last refit failed; see the commit mode for what the engine serves


class RefitEvent(enum.Enum):
    BEGIN = "begin"
    BUCKET = "bucket"
    FINALIZE = "finalize"
    COMMIT = "commit"
    FAIL = "fail"


S, E = RefitState, RefitEvent

# The whole lifecycle. A (state, event) pair that is not here is an illegal move.
TRANSITIONS: dict[tuple[RefitState, RefitEvent], RefitState] = {
    (S.IDLE, E.BEGIN): S.STAGING,
    (S.LIVE, E.BEGIN): S.STAGING,
    (S.FAILED, E.BEGIN): S.STAGING,
    (S.STAGING, E.BUCKET): S.STAGING,
    (S.STAGING, E.FINALIZE): S.FINALIZING,
    (S.FINALIZING, E.COMMIT): S.LIVE,
    (S.STAGING, E.FAIL): S.FAILED,
    (S.FINALIZING, E.FAIL): S.FAILED,
}


class CommitMode(enum.Enum):
    """How an engine moves staged weights into its live storage.

    TRANSACTIONAL: live weights are untouched until every bucket is in and verified; a failure
        leaves them bit-identical. Extra memory: the staged (quantized) tensors of the model.
    PER_LAYER: each layer is committed once all its tensors are in; extra memory is bounded by
        one layer. A failure marks the engine stale until a full refit succeeds.
    """

    TRANSACTIONAL = "transactional"
    PER_LAYER = "per-layer"

    @classmethod
    def parse(cls, value: str | CommitMode) -> CommitMode:
        """Read a commit mode by its value (`transactional`, `per-layer`).

        Args:
            value: the mode or its value (`per_layer` is accepted too).

        Returns:
            The CommitMode. Raises ValueError naming the valid values.
        """
        if isinstance(value, CommitMode):
            return value
        key = str(value).strip().lower().replace("_", "-")
        for mode in cls:
            if key == mode.value:
                return mode
        raise ValueError(f"unknown commit mode {value!r}; valid: transactional, per-layer")


@attrs.define
class RefitSession:
    """The lifecycle of one side of a refit (the service's, or an engine's own bookkeeping).

    Attributes:
        state: where the lifecycle stands.
        refit_id: the id of the current (or last) refit.
        next_bucket: index the next bucket must carry.
        last_received: True once the bucket marked last has been accepted.
    """

    state: RefitState = RefitState.IDLE
    refit_id: int | None = None
    next_bucket: int = 0
    last_received: bool = False

    def _move(self, event: RefitEvent) -> None:
        target = TRANSITIONS.get((self.state, event))
        if target is None:
            raise RefitLifecycleError(
                f"refit {self.refit_id}: cannot {event.value} while {self.state.value}; "
                f"{_HINTS.get(event, '')}".rstrip("; ")
            )
        self.state = target

    @property
    def in_progress(self) -> bool:
        """True while a refit is staging or finalizing."""
        return self.state in (RefitState.STAGING, RefitState.FINALIZING)

    def begin(self, refit_id: int) -> None:
        """Open refit `refit_id` (from IDLE, LIVE or FAILED).

        Args:
            refit_id: an id chosen by the caller, reported in errors.

        Returns:
            None. Raises RefitLifecycleError when a refit is already in progress.
        """
        self._move(RefitEvent.BEGIN)
        self.refit_id = refit_id
        self.next_bucket = 0
        self.last_received = False

    def accept(self, bucket: Bucket) -> None:
        """Accept the next bucket: it must carry the expected index and come before the last.

        Args:
            bucket: the bucket about to be staged.

        Returns:
            None. Raises BucketSequenceError (out of order, duplicate, after the last) or
            RefitLifecycleError (no refit staging).
        """
        if self.state is RefitState.STAGING:
            if self.last_received:
                raise BucketSequenceError(
                    f"refit {self.refit_id}: bucket {bucket.index} arrived after the last bucket "
                    f"({self.next_bucket - 1}); start a new refit to send more"
                )
            if bucket.index != self.next_bucket:
                what = "a duplicate" if bucket.index < self.next_bucket else "out of order"
                raise BucketSequenceError(
                    f"refit {self.refit_id}: bucket {bucket.index} is {what}; expected bucket "
                    f"{self.next_bucket} (buckets arrive in order, exactly once)"
                )
        self._move(RefitEvent.BUCKET)
        self.next_bucket += 1
        self.last_received = bucket.is_last

    def finalize(self) -> None:
        """Move to FINALIZING: allowed once per refit, after the last bucket.

        Returns:
            None. Raises BucketSequenceError when the last bucket has not arrived, or
            RefitLifecycleError on a second finalize or when no refit is staging.
        """
        if self.state is RefitState.STAGING and not self.last_received:
            raise BucketSequenceError(
                f"refit {self.refit_id}: finalize before the last bucket (received "
                f"{self.next_bucket}, none marked last); send the remaining buckets or abort"
            )
        self._move(RefitEvent.FINALIZE)

    def commit(self) -> None:
        """Move to LIVE after a successful finalize."""
        self._move(RefitEvent.COMMIT)

    def fail(self) -> None:
        """Move to FAILED from STAGING or FINALIZING."""
        self._move(RefitEvent.FAIL)


_HINTS = {
    RefitEvent.BEGIN: "finalize or abort the refit in progress first",
    RefitEvent.BUCKET: "call begin first",
    RefitEvent.FINALIZE: "finalize runs once per refit, after its last bucket",
    RefitEvent.COMMIT: "commit follows a finalize",
    RefitEvent.FAIL: "no refit is in progress",
}


# --- fault scripts (tests and `refit demo --inject-fault`) ---------------------------------


class FaultPoint(enum.Enum):
    BUCKET = "bucket"  # while loading bucket K
    FINALIZE = "finalize"  # while post-processing, before anything is verified or committed
    VERIFY = "verify"  # when the staged weights are verified, just before they are committed


@attrs.frozen
class FaultScript:
    """Where a scripted engine fails, and for how many refits.

    Attributes:
        point: the lifecycle step that fails.
        bucket_index: for BUCKET, the index of the bucket whose load fails.
        after: how many refits succeed before the first scripted failure.
        refits: how many refits fail (the next ones succeed).
    """

    point: FaultPoint
    bucket_index: int | None = None
    after: int = 0
    refits: int = 1

    def __attrs_post_init__(self) -> None:
        if (self.point is FaultPoint.BUCKET) != (self.bucket_index is not None):
            raise ValueError("a bucket fault needs bucket_index >= 0; other faults take none")
        if self.bucket_index is not None and self.bucket_index < 0:
            raise ValueError(f"bucket_index must be >= 0, got {self.bucket_index}")
        if self.after < 0 or self.refits < 0:
            raise ValueError("after and refits count refits: they must be >= 0")

    def fails(self, refit_number: int) -> bool:
        """Whether the refit_number-th refit (from 0) is one the script fails."""
        return self.after <= refit_number < self.after + self.refits

    @classmethod
    def parse(cls, text: str) -> FaultScript:
        """Read `bucket:K`, `finalize` or `verify`.

        Args:
            text: the fault's spelling, as `refit demo --inject-fault` takes it.

        Returns:
            The FaultScript. Raises ValueError saying what is accepted.
        """
        head, _, tail = text.strip().lower().partition(":")
        try:
            point = FaultPoint(head)
            index = int(tail) if point is FaultPoint.BUCKET else None
            if point is not FaultPoint.BUCKET and tail:
                raise ValueError
            return cls(point, index)
        except ValueError:
            raise ValueError(f"unknown fault {text!r}; use bucket:K (K >= 0), finalize or verify") from None

    def __str__(self) -> str:
        return f"bucket:{self.bucket_index}" if self.point is FaultPoint.BUCKET else self.point.value


# --- engine-side results and the storage check ----------------------------------------------


@attrs.frozen
class StorageRecord:
    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> StorageRecord:
        return cls(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


@attrs.frozen
class StorageFingerprint:
    """The identity of every captured live tensor, by name."""

    records: dict[str, StorageRecord]

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> StorageFingerprint:
        return cls({name: StorageRecord.of(t) for name, t in tensors.items()})

    def differences(self, after: StorageFingerprint) -> list[str]:
        """Names whose pointer, shape, stride or dtype changed, or that appeared or vanished."""
        names = sorted(set(self.records) | set(after.records))
        return [n for n in names if self.records.get(n) != after.records.get(n)]


@attrs.frozen
class EngineFinalizeResult:
    """What the engine reports after a successful finalize.

    Attributes:
        kv_scales_reset: attention layers whose q/k/v/prob scales were reset to 1.0.
        postprocess_seconds: time spent post-processing (run once per refit).
        tensors_committed: live tensors written by in-place copy.
        peak_staging_bytes: the most bytes the engine held staged at once during this refit.
    """

    kv_scales_reset: int = 0
    postprocess_seconds: float = 0.0
    tensors_committed: int = 0
    peak_staging_bytes: int = 0


class RefitOutcome(enum.Enum):
    LIVE = "live"  # committed and verified
    ROLLED_BACK = "rolled-back"  # failed; live weights are the previous refit's, bit for bit
    STALE = "stale"  # failed after live weights were touched; the engine refuses to serve


@attrs.frozen
class StorageCheck:
    """The captured-storage check after a refit.

    Attributes:
        checked: False when the refit failed before the check could run.
        changed: names whose data pointer, shape, stride or dtype changed.
    """

    checked: bool
    changed: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.checked and not self.changed

    def __str__(self) -> str:
        if not self.checked:
            return "not run"
        return "ok" if not self.changed else f"REBOUND ({len(self.changed)})"


@attrs.frozen
class RefitReport:
    """Everything one refit did, measured.

    Attributes:
        refit_id: the refit's id.
        outcome: LIVE, ROLLED_BACK or STALE.
        plan: the quantization plan, in words (e.g. "linear=FP8_BLOCK moe=NVFP4").
        commit_mode: the engine's commit mode, when it reports one.
        source_bytes: bytes of the trainer's weights (BF16) that went into the refit.
        bytes_sent: bytes of checkpoint-format tensors sent (bucket payloads).
        buckets: buckets sent (a failed refit counts those sent before the failure).
        tensors: checkpoint-format tensors sent.
        timings: seconds per phase: export, quantize, pack, load, finalize, verify, total.
        peak_staging_bytes: most bytes the engine held staged at once.
        bucket_bytes: the bucket capacity used.
        storage: the captured-storage check.
        kv_scales_reset: attention layers whose KV-cache scales were reset to 1.0.
        error: the failure, in words (None when LIVE).
    """

    refit_id: int
    outcome: RefitOutcome
    plan: str
    commit_mode: str | None
    source_bytes: int
    bytes_sent: int
    buckets: int
    tensors: int
    timings: dict[str, float]
    peak_staging_bytes: int
    bucket_bytes: int
    storage: StorageCheck
    kv_scales_reset: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.outcome is RefitOutcome.LIVE

    @property
    def throughput_gbps(self) -> float:
        """GB (1e9 bytes) of source (BF16) weights refitted per second of total time."""
        total = self.timings.get("total", 0.0)
        return self.source_bytes / total / 1e9 if total > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dictionary."""
        d = attrs.asdict(self, recurse=False)
        d["outcome"] = self.outcome.value
        d["storage"] = {"checked": self.storage.checked, "ok": self.storage.ok, "changed": list(self.storage.changed)}
        d["throughput_gbps"] = self.throughput_gbps
        return d
