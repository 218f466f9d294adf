"""Refit errors: the lifecycle, buckets, the commit and its checks, injected faults, mismatch metrics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from domain.errors.base import RefitError

if TYPE_CHECKING:  # values of the refit, for the errors that carry them
    from domain.refit.report import RefitReport


class RefitLifecycleError(RefitError, RuntimeError):
    """A refit step arrived in a state that does not accept it."""


class BucketSequenceError(RefitLifecycleError):
    """A bucket arrived out of order, twice, or the sequence ended early."""


class StorageRebound(RefitError, RuntimeError):
    """A tensor captured by CUDA graphs changed data pointer, shape, stride or dtype."""


class RefitFailed(RefitError, RuntimeError):
    """A refit failed; the message says what state the engine was left in. Carries the refit's report."""

    def __init__(self, message: str, *, report: RefitReport) -> None:
        self.report = report
        super().__init__(message)


class BucketLayoutError(RefitError, ValueError):
    """A bucket's layout is inconsistent (overlap, wrong size, repeated name, bad bucket size)."""


class DeltaBaseMismatch(RefitError, ValueError):
    """A delta refit's tensor does not apply: the receiver's copy of it is missing, differs from
    the base the delta was made against, or patches into bytes other than the sender's. The refit
    fails through the normal transaction; RefitService then sends the same refit whole."""


class DeltaRecordError(RefitError, ValueError):
    """A delta record is malformed (wrong magic, truncated, inconsistent sizes)."""


class RefitVerificationFailed(RefitError, RuntimeError):
    """The engine's check of the staged weights failed before (or while) committing them."""


class RefitIncomplete(RefitError, RuntimeError):
    """A refit finished but left engine parameters it should have written untouched (they hold
    older weights). Carries their names."""

    def __init__(self, refit_id: int, unwritten: Sequence[str]) -> None:
        self.unwritten = tuple(unwritten)
        shown = ", ".join(self.unwritten[:5]) + (", ..." if len(self.unwritten) > 5 else "")
        super().__init__(
            f"refit {refit_id}: {len(self.unwritten)} engine parameters were never written ({shown}); the "
            "refit stream lacks tensors the engine's model has: export from the model the engine serves"
        )


class ProbeMismatch(RefitVerificationFailed):
    """The post-refit probe: the engine's log-probs on the probe batch differ from the reference
    by more than the plan's bound. The engine is marked stale."""

    def __init__(self, refit_id: int, max_abs_diff: float, bound: float, reference: str) -> None:
        self.max_abs_diff = max_abs_diff
        self.bound = bound
        super().__init__(
            f"refit {refit_id}: the engine's log-probs on the probe batch differ from the {reference} "
            f"by up to {max_abs_diff:.6g} (bound {bound:.6g}); the engine serves other weights than "
            "the trainer sent and refuses to serve until a refit passes the probe"
        )


class InjectedFault(RefitError, RuntimeError):
    """A failure injected on purpose by a fault script (tests, `refit demo --inject-fault`)."""


class MismatchInputError(RefitError, ValueError):
    """Log-probs or masks handed to the mismatch metrics do not fit together."""
