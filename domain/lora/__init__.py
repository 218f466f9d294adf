"""LoRA refits: the adapter as a value, its validation, PEFT's merge, the engines' packing, the bytes.

Pure (stdlib, attrs, torch). The trainer sources that build a `LoraAdapter` live in their adapters
(`adapters/hf/lora.py`, `adapters/megatron/lora.py`).
"""

from __future__ import annotations

from domain.errors import (
    LoraError,
    LoraNonFinite,
    LoraRankMismatch,
    LoraShapeMismatch,
    LoraUnknownTarget,
    LoraUnsupported,
)
from domain.lora.accounting import WIRE_BUDGET_FACTOR, LoraBytes
from domain.lora.adapter import PEFT_PREFIX, LoraAdapter, LoraWeights, check_fits
from domain.lora.merge import delta_weight, merge_weight, merged_stream
from domain.lora.packing import PACKED_MODULES, PackedLora, pack

__all__ = [
    "PACKED_MODULES", "PEFT_PREFIX", "WIRE_BUDGET_FACTOR", "LoraAdapter", "LoraBytes", "LoraError",
    "LoraNonFinite", "LoraRankMismatch", "LoraShapeMismatch", "LoraUnknownTarget", "LoraUnsupported",
    "LoraWeights", "PackedLora", "check_fits", "delta_weight", "merge_weight", "merged_stream", "pack",
]
