"""Port: a source of trainer weights exported into the rollout's checkpoint layout."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from domain.quant.plan import QuantizationPlan


class WeightExporter(Protocol):
    """Streams a model's weights, quantized per a plan, one tensor (or fused group) at a time."""

    def tensor_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every source tensor's name and shape, in layer order, without loading any tensor.

        Returns:
            (Hugging Face name, shape) pairs; what `QuantizationPlan.decide` and the dispatch
            rules need before anything is exported.
        """
        ...

    def export(self, plan: QuantizationPlan) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the checkpoint tensors of the quantized model, in layer order.

        Args:
            plan: the quantization plan (BF16 plans yield the weights unchanged).

        Returns:
            An iterator of (checkpoint name, tensor): per fused NVFP4 group the global scale is
            computed over the whole group before any of its tensors is yielded. Never holds more
            than one fused group's source weights at a time.
        """
        ...
