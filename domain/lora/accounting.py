"""Bytes per refit in the two modes: what the wire budget of an adapter refit is measured against.

An adapter refit may move at most `WIRE_BUDGET_FACTOR` times the adapter's own bytes (headers,
alignment padding and per-slice copies included); a merged refit moves the whole (quantized)
model, or at least every weight the adapter touches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs
import torch

from domain.lora.adapter import LoraAdapter

WIRE_BUDGET_FACTOR = 2


@attrs.frozen
class LoraBytes:
    """An adapter's bytes, and what a merged refit of the same modules moves.

    Args:
        adapter: every lora_A and lora_B.
        merged_targets: the full weights the adapter modifies, in the base dtype (a merged
            refit's floor: it sends at least these).
    """

    adapter: int
    merged_targets: int

    @property
    def wire_budget(self) -> int:
        """The most an adapter refit may put on the wire."""
        return WIRE_BUDGET_FACTOR * self.adapter

    def within_budget(self, sent: int) -> bool:
        """Whether `sent` bytes for one adapter refit keep to the budget."""
        return sent <= self.wire_budget

    @classmethod
    def of(cls, adapter: LoraAdapter, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype) -> LoraBytes:
        """Count an adapter against its base model.

        Args:
            adapter: the adapter.
            shapes: the base model's weight name -> shape.
            dtype: the base weights' dtype.
        """
        adapter.check_base(shapes)
        merged = sum(math.prod(shapes[f"{m}.weight"]) * dtype.itemsize for m in adapter.modules)
        return cls(adapter=adapter.nbytes, merged_targets=merged)
