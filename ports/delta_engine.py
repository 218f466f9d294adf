"""Port: a rollout engine that keeps a delta receiver (docs/refit.md#delta-refits)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from domain.refit.delta_sync import DeltaBase


@runtime_checkable
class DeltaEngine(Protocol):
    """An engine whose refits may carry delta records (`domain.refit.delta`).

    The first call turns the engine's receiver on: from then on it keeps a host copy of the
    checkpoint-format tensors it loads (the quantized model's bytes) and patches delta records into
    whole tensors before its normal load. An engine never asked keeps nothing.
    """

    def delta_base(self) -> DeltaBase:
        """The receiver's copy: its digest (None when it holds none), bytes, and the last refit's
        receiving seconds. Asked before each refit (full or delta) and after it (for the report)."""
        ...
