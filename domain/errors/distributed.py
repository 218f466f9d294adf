"""Distributed refit errors: sharding, the bucket transport, collective and peer failures."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from domain.errors.base import RefitError
from domain.errors.refit import RefitFailed

if TYPE_CHECKING:  # values of the refit, for the errors that carry them
    from domain.refit.report import RefitReport
    from domain.refit.status import RankStatus


class ShardingError(RefitError, ValueError):
    """A parallel layout does not fit the model or the refit world. Carries the tensor or config key."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


class CollectiveTimeout(RefitError, TimeoutError):
    """A collective did not complete in time: a peer is hung or gone. Names the rank and the step.

    `report`: the rank's report of the refit it broke, set by the refit service that was running.
    """

    report: RefitReport | None = None

    def __init__(self, rank: int | None, step: str, seconds: float, peers: tuple[int, ...] = ()) -> None:
        self.rank = rank
        self.step = step
        self.seconds = seconds
        self.peers = peers
        who = f"rank {rank}" if rank is not None else "in-process receiver"
        with_ = f" with ranks {list(peers)}" if peers else ""
        super().__init__(
            f"{who}: timed out after {seconds:g} s at step {step!r}{with_}; a peer is hung or gone "
            "(check its log). The process group is no longer usable: restart the refit world"
        )


class PeerLost(RefitError, ConnectionError):
    """A collective failed because a peer closed its connection (it crashed or exited).

    `report`: the rank's report of the refit it broke, set by the refit service that was running.
    """

    report: RefitReport | None = None


class TransportAborted(RefitError, RuntimeError):
    """The source stopped the bucket stream; the message carries the source's error."""


class PeerFailed(RefitError, RuntimeError):
    """A peer rank failed (its own error says why); this rank stopped the same refit with it."""


class RankFailed(RefitError, RuntimeError):
    """A process of a local world (`refit demo procs N`, `refit demo megatron`) stopped on a typed
    error of its own; the message names the rank and carries that error."""


class SharedMemoryUnavailable(RefitError, OSError):
    """The shared-memory ring of a same-host bucket stream could not be made (no memory for it,
    no memfd_create); the message names the size, the system's reason and what to do."""


class WireProtocolError(RefitError, RuntimeError):
    """A transport message is not the one expected (another refit, a corrupt header): ranks are out of step."""


class DistributedRefitFailed(RefitFailed):
    """Every rank of a distributed refit raises this when any rank failed; the message names the
    failing ranks and steps and what each engine did (kept, restored or stale). Carries this
    rank's report and every rank's final status (the same on every rank)."""

    def __init__(self, message: str, *, report: RefitReport, statuses: Sequence[RankStatus]) -> None:
        self.statuses = tuple(statuses)
        super().__init__(message, report=report)
