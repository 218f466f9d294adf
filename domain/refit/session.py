"""The refit session: its state machine and the engines' commit modes.

A session moves IDLE -> STAGING -> FINALIZING -> LIVE, or -> FAILED (docs/refit.md#the-lifecycle).
The moves are an explicit transition table; every other move raises a typed error. Buckets
arrive in order and exactly once; finalize comes once, after the last bucket.
"""

from __future__ import annotations

import enum

import attrs

from domain.errors import BucketSequenceError, RefitLifecycleError
from domain.refit.buckets import Bucket


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


def move(state: RefitState, event: RefitEvent, refit_id: int | None) -> RefitState:
    """The state `event` leads to from `state` (the TRANSITIONS table).

    Args:
        state: where the lifecycle stands.
        event: what happens.
        refit_id: the refit, for the error.

    Returns:
        The next state. Raises RefitLifecycleError, with what to do, for an illegal move.
    """
    target = TRANSITIONS.get((state, event))
    if target is None:
        raise RefitLifecycleError(
            f"refit {refit_id}: cannot {event.value} while {state.value}; {_HINTS.get(event, '')}".rstrip("; ")
        )
    return target


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
        self.state = move(self.state, event, self.refit_id)

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
