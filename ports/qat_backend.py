"""Port: quantization-aware training, fake-quantizing a trainer model the way the rollout serves it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from domain.quant.plan import QuantizationPlan
from domain.quant.qat import LayerPrecision, QatSummary


class QatBackend(Protocol):
    """Puts fake-quantization into a trainer model's forward for a rollout plan, and takes it out.

    Contract: after `apply(model, plan)`, every forward of `model` computes each Linear and
    expert layer the plan quantizes with weights bit-identical to dequantize(exported tensors)
    of the current weights, and with the plan's activation scheme on its input; gradients pass
    straight through. One backend instance serves one model at a time.
    """

    name: str

    def apply(self, model: torch.nn.Module, plan: QuantizationPlan) -> QatSummary:
        """Install fake-quantization for `plan` on `model` (in place).

        Args:
            model: the trainer model (a torch / transformers module or a Megatron-Core model).
            plan: the QAT plan (the rollout plan, checked by `domain.quant.qat_checks.check_qat_plan`).

        Returns:
            The QatSummary: the model's Linear and expert tensors with their Hugging Face names,
            and the precision installed on each. Raises QatStateError when already applied.
        """
        ...

    def refresh(self, model: torch.nn.Module) -> None:
        """Bring scales the backend holds up to date with the weights; call after every optimizer step.

        Args:
            model: the model `apply` was given.

        Returns:
            None. Raises QatStateError before `apply`.
        """
        ...

    def remove(self, model: torch.nn.Module) -> None:
        """Take the fake-quantization out: the model computes in its own precision again.

        Args:
            model: the model `apply` was given.

        Returns:
            None. A second call is a no-op.
        """
        ...

    def effective_precision(self, model: torch.nn.Module) -> Mapping[str, LayerPrecision]:
        """What each Linear and expert tensor computes with now, read from the model.

        Args:
            model: the model `apply` was given.

        Returns:
            trainer tensor name -> LayerPrecision (BF16 / none where nothing is installed).
        """
        ...
