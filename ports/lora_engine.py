"""Port: a rollout engine that serves a LoRA adapter beside its base weights (`actor.lora.sync:
adapter`), and replaces it atomically."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from domain.lora.adapter import LoraAdapter
from domain.lora.sync import StagedAdapter


@runtime_checkable
class LoraEngine(Protocol):
    """An engine whose served adapter is replaced in two steps, so that no request ever sees a
    half-loaded one: `stage_adapter` builds the new adapter under a fresh id on every worker while
    the old one serves; `commit_adapter` then moves the served name to it and drops the old id.
    `abort_adapter` drops a staged id instead. The engine applies the adapter's scaling
    (lora_alpha / r) exactly once, to tensors it owns.
    """

    @property
    def serving_adapter(self) -> int | None:
        """The id every request is served with (None: the base model alone)."""
        ...

    def stage_adapter(self, adapter: LoraAdapter) -> StagedAdapter:
        """Build `adapter` under a fresh id on every worker; nothing serves it yet.

        Raises:
            AdapterUpdateFailed: a worker could not build or hold it (the id is dropped on every
                worker first; the served adapter is untouched).
        """
        ...

    def commit_adapter(self, staged: StagedAdapter) -> None:
        """Serve `staged` from now on, then drop the previous id on every worker (and whatever the
        engine cached for it, such as prefix-cache entries)."""
        ...

    def abort_adapter(self, staged: StagedAdapter) -> None:
        """Drop a staged id on every worker (idempotent); the served adapter is untouched."""
        ...
