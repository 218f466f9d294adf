"""The adapter mode's records: an adapter staged in an engine, and the report of one update.

An update stages the new adapter under a fresh id on every worker (the old one keeps serving),
then moves the served name to it and drops the old id. A failure before the move leaves the old
adapter serving; the staged id is dropped.
"""

from __future__ import annotations

import attrs

from domain.lora.adapter import LoraAdapter
from domain.refit.report import RefitReport


def peft_config(adapter: LoraAdapter) -> dict[str, object]:
    """The adapter's `adapter_config.json` as PEFT writes it (the fields an engine reads)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": adapter.r, "lora_alpha": adapter.lora_alpha,
        "target_modules": sorted(adapter.target_modules), "use_rslora": adapter.use_rslora, "bias": "none",
        "lora_dropout": 0.0, "fan_in_fan_out": False, "use_dora": False, "modules_to_save": None,
    }


@attrs.frozen
class StagedAdapter:
    """An adapter every worker of an engine holds under `adapter_id`, not yet served.

    Attributes:
        adapter_id: the engine's id for it (fresh for every update).
        bytes_sent: what staging put on the wire to the engine (its serialized tensors and config).
    """

    adapter_id: int
    bytes_sent: int


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
