"""The adapter mode's records: an adapter's PEFT configuration, and an adapter staged in an engine.

An update stages the new adapter under a fresh id on every worker (the old one keeps serving),
then moves the served name to it and drops the old id. A failure before the move leaves the old
adapter serving; the staged id is dropped.
"""

from __future__ import annotations

import attrs

from domain.lora.adapter import LoraAdapter


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
