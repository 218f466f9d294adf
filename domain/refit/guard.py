"""An engine's own refit guard: its session, why it does not serve, and the refusal to serve.

Every engine adapter keeps one by composition. The guard is the engine side's bookkeeping only:
buckets in order and exactly once, finalize once after the last bucket (the session's transition
table), and a stale reason that makes the engine refuse to serve until a full refit commits.
What a failure does to the live weights is each engine's own business; it tells the guard whether
the engine is stale afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import attrs

from domain.errors import EngineBusy, EngineClosed, EngineStale, RefitInProgress
from domain.refit.buckets import Bucket
from domain.refit.session import RefitSession

NOT_REFITTED = "no refit has completed yet"


@attrs.define
class EngineGuard:
    """The refit bookkeeping every engine adapter shares.

    Attributes:
        on_fail: the engine's own handling of a failed refit (drop what it staged, put its live
            weights back together, tell the guard with `fail` whether it is now stale), called by
            `abort` and `mark_stale` while a refit is in progress.
        session: the engine side's refit session.
        stale_reason: why the engine refuses to serve, or None when it serves. An engine starts
            stale: until its first refit its weights are whatever it was built or started with.
        closed: `close()` was called: the engine neither refits nor serves.
    """

    on_fail: Callable[[str], None] | None = None
    session: RefitSession = attrs.field(factory=RefitSession)
    stale_reason: str | None = NOT_REFITTED
    closed: bool = False
    # begin is atomic: of two threads beginning at once, one refit begins and the other is told so
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)
    _owner: int | None = attrs.field(default=None, init=False, repr=False)

    @property
    def refit_id(self) -> int | None:
        return self.session.refit_id

    @property
    def in_progress(self) -> bool:
        return self.session.in_progress

    @property
    def is_stale(self) -> bool:
        return self.stale_reason is not None

    def begin(self, refit_id: int) -> None:
        """Open refit `refit_id`.

        Raises:
            EngineClosed: after `close()`.
            RefitInProgress: another thread's refit is in progress (this one changes nothing).
            RefitLifecycleError: this thread's own refit is in progress.
        """
        with self._lock:
            self.check_open()
            if self.session.in_progress and self._owner != threading.get_ident():
                raise RefitInProgress(
                    f"refit {refit_id} did not begin: refit {self.session.refit_id} of another thread is "
                    f"{self.session.state.value} on this engine; this one changed nothing. Refit an engine from "
                    "one thread at a time, or wait for that refit to end")
            self.session.begin(refit_id)
            self._owner = threading.get_ident()

    def accept(self, bucket: Bucket) -> None:
        """Accept the next bucket; BucketSequenceError when it is out of order, twice or late."""
        self.check_open()
        self.session.accept(bucket)

    def finalize(self) -> None:
        """Move to finalizing; BucketSequenceError before the last bucket, RefitLifecycleError twice."""
        self.check_open()
        self.session.finalize()

    def check_open(self) -> None:
        """Raise EngineClosed after `close()`."""
        if self.closed:
            raise EngineClosed("the engine was closed: it neither refits nor serves; build a new engine")

    def close(self) -> None:
        """The engine is closing: abort a refit in progress (its `on_fail`), then refuse every refit
        and every request with EngineClosed."""
        self.abort("the engine was closed")
        self.closed = True

    def commit(self) -> None:
        """The refit is live: the engine serves it."""
        self.session.commit()
        self.stale_reason = None

    def fail(self, stale_reason: str | None = None) -> None:
        """End the refit in progress as failed (nothing happens when none is).

        Args:
            stale_reason: set when the failure left the live weights incomplete: the engine then
                refuses to serve until a full refit commits. None keeps the current state.
        """
        if self.session.in_progress:
            self.session.fail()
        if stale_reason is not None:
            self.stale_reason = stale_reason

    def abort(self, reason: str) -> None:
        """RolloutEngine.abort_refit: the engine's `on_fail` for a refit in progress, else nothing."""
        if self.session.in_progress:
            if self.on_fail is not None:
                self.on_fail(reason)
            self.fail()

    def mark_stale(self, reason: str) -> None:
        """RolloutEngine.mark_stale: abort a refit in progress, then refuse to serve until a full
        refit commits."""
        self.abort(reason)
        self.stale_reason = reason

    def check_serving(self) -> None:
        """Raise EngineClosed after close, EngineBusy while a refit is in progress and EngineStale
        while stale."""
        self.check_open()
        if self.session.in_progress:
            raise EngineBusy(
                f"refit {self.session.refit_id} is {self.session.state.value}; the engine does not serve "
                "until it is finalized or aborted"
            )
        if self.stale_reason is not None:
            raise EngineStale(f"engine is stale ({self.stale_reason}); run a full refit before serving")
