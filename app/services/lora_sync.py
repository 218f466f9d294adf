"""The adapter mode (`actor.lora.sync: adapter`): each step sends the LoRA adapter alone, and the
base model only when it changed, into an engine that serves the adapter beside its base weights.

One step, `LoraSyncService.sync()`:

1. stage the new adapter under a fresh id on every worker (the previous one keeps serving);
2. refit the base when it changed (the first step, an engine left stale, or `base_changed=True`),
   through the ordinary refit transaction (`RefitService`);
3. move the served name to the new id and drop the previous id.

A failure at 1 or 2 drops the staged id and leaves the previous adapter serving; the base refit
settles as any refit does (restored, or stale and refusing), so a base and an adapter of the same
step go live together or not at all.
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

import attrs
import structlog

from app.services.refit import RefitService
from domain.errors import AdapterUpdateFailed, RefitFailed
from domain.lora.adapter import LoraAdapter
from domain.lora.sync import StagedAdapter
from domain.refit.report import RefitReport
from ports.lora_engine import LoraEngine
from ports.trainer_model import TrainerModel


@attrs.frozen
class AdapterUpdateReport:
    """One adapter-mode step: the base refit when the base changed, and the adapter update.

    Attributes:
        update: the update's number (1 = the first).
        live: the new adapter serves (and the base refit, if any, went live with it).
        adapter_id: the id that serves after the step (the new one, or the previous one).
        previous_id: the id that served before it (None: none did).
        bytes_sent: the adapter's bytes on the wire (staging); the base refit's are in `base`.
        adapter_bytes: the adapter's own bytes (every lora_A and lora_B).
        base: the base refit's report, when the step refitted the base.
        error: why the step did not go live (None when it did).
        seconds: wall-clock time of the whole step.
    """

    update: int
    live: bool
    adapter_id: int | None
    previous_id: int | None
    bytes_sent: int
    adapter_bytes: int
    base: RefitReport | None
    error: str | None
    seconds: float

    def to_dict(self) -> dict[str, object]:
        return {
            "update": self.update, "live": self.live, "adapter_id": self.adapter_id, "previous_id": self.previous_id,
            "bytes_sent": self.bytes_sent, "adapter_bytes": self.adapter_bytes,
            "base": None if self.base is None else self.base.to_dict(), "error": self.error, "seconds": self.seconds,
        }


@runtime_checkable
class LoraTrainerModel(Protocol):
    """A trainer with a LoRA adapter: the frozen base model and the trainable adapter."""

    @property
    def base(self) -> TrainerModel: ...

    @property
    def adapter(self) -> LoraAdapter: ...


@attrs.define
class LoraSyncService:
    """Adapter-mode steps from a LoRA trainer into an engine that serves adapters.

    Attributes:
        trainer: the trainer (its `base` and its `adapter`).
        engine: the engine (LoraEngine port; `base_refit.engine` is the same engine).
        base_refit: refits the trainer's base into the engine (built on `trainer.base`).
        reports: every step's report, oldest first.
    """

    trainer: LoraTrainerModel
    engine: LoraEngine
    base_refit: RefitService
    reports: list[AdapterUpdateReport] = attrs.field(factory=list)
    _base_synced: bool = attrs.field(init=False, default=False)

    def sync(self, *, base_changed: bool = False) -> AdapterUpdateReport:
        """One adapter-mode step.

        Args:
            base_changed: the trainer's base weights changed since the last step (the first step,
                and a step after a failed base refit, send the base whatever this says).

        Returns:
            The step's report; `live` False when it did not go live (its `error` says why; the
            previous adapter still serves, or, after a base refit that left the engine stale,
            nothing serves until a step succeeds).
        """
        start = time.perf_counter()
        update, previous = len(self.reports) + 1, self.engine.serving_adapter
        log = structlog.get_logger().bind(update=update, previous=previous)
        adapter = self.trainer.adapter
        staged: StagedAdapter | None = None
        base: RefitReport | None = None
        try:
            staged = self.engine.stage_adapter(adapter)
            if base_changed or not self._base_synced:
                self._base_synced = False
                try:
                    base = self.base_refit.refit()
                except RefitFailed as failed:
                    base = failed.report
                    raise AdapterUpdateFailed(f"the base refit failed: {failed.report.error}", previous) from failed
                self._base_synced = True
            self.engine.commit_adapter(staged)
        except AdapterUpdateFailed as err:
            if staged is not None:
                self.engine.abort_adapter(staged)
            log.warning("adapter update failed", error=str(err))
            report = AdapterUpdateReport(update, False, previous, previous, staged.bytes_sent if staged else 0,
                                         adapter.nbytes, base, str(err), time.perf_counter() - start)
        else:
            report = AdapterUpdateReport(update, True, staged.adapter_id, previous, staged.bytes_sent, adapter.nbytes,
                                         base, None, time.perf_counter() - start)
            log.info("adapter update live", adapter_id=staged.adapter_id, bytes_sent=staged.bytes_sent,
                     base_refit=base is not None)
        self.reports.append(report)
        return report
