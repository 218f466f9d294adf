"""The embedded reference model as a trainable torch module, for QAT and the `refit demo qat` run.

The reference model (`adapters.reference`) keeps its weights in a fused layout and scores tokens
with a functional forward; this module holds those fused tensors as parameters and runs the same
forward with gradients, so an optimizer can train it and a QAT backend can fake-quantize it.
`trainer()` hands the same storage to a `ReferenceTrainer`, so a refit sends what was trained.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from adapters.reference.config import ReferenceModelConfig
from adapters.reference.model import check_input_ids, forward_logits, log_probs_from_logits
from adapters.reference.trainer import ReferenceTrainer, init_weights

# The reference forward is decorated with torch.no_grad() for scoring; training needs the
# undecorated function (functools.wraps keeps it as __wrapped__).
_forward = getattr(forward_logits, "__wrapped__", forward_logits)


class EmbeddedModule(torch.nn.Module):
    """The reference model with one trainable parameter per fused tensor (`layers.0.qkv` -> `layers_0_qkv`).

    Attributes:
        config: the model's shapes.
    """

    def __init__(self, config: ReferenceModelConfig, weights: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.config = config
        self.keys = tuple(weights)
        for key, t in weights.items():
            self.register_parameter(self.param_name(key), torch.nn.Parameter(t.detach().clone()))

    @classmethod
    def from_seed(cls, config: ReferenceModelConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> EmbeddedModule:
        """Random weights from `seed`, as `ReferenceTrainer.from_seed` makes them."""
        return cls(config, init_weights(config, seed, dtype))

    @staticmethod
    def param_name(key: str) -> str:
        """The parameter name of a fused key (`layers.0.qkv` -> `layers_0_qkv`)."""
        return key.replace(".", "_")

    def fused(self) -> dict[str, torch.Tensor]:
        """Fused key -> the tensor the forward uses now (a fake-quantized one while QAT is active)."""
        return {key: self._parameters[self.param_name(key)] for key in self.keys}  # type: ignore[misc]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """float32 logits [B, T, V], with gradients."""
        check_input_ids(self.config, input_ids)
        return _forward(self.config, self.fused(), input_ids)

    def log_probs(self, input_ids: torch.Tensor, *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of each next token and entropies, float32 [B, T - 1] (no gradients)."""
        with torch.no_grad():
            return log_probs_from_logits(self(input_ids), input_ids, temperature)

    def trainer(self) -> ReferenceTrainer:
        """A ReferenceTrainer over this module's parameters (same storage, detached): what a refit reads."""
        return ReferenceTrainer(self.config, {k: self.get_parameter(self.param_name(k)).detach() for k in self.keys})
