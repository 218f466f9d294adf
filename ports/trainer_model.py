"""Port: the trainer's model, as the refit and the mismatch probe see it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch


class TrainerModel(Protocol):
    """A policy model on the trainer side."""

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) in layer order, with Hugging Face names (`model.layers.0...`).

        Returns:
            An iterable of full, unsharded tensors in the trainer's dtype.
        """
        ...

    def log_probs(
        self, input_ids: torch.Tensor, *, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities of each next token, and the entropy of each next-token distribution.

        Args:
            input_ids: int64 [B, T] token ids.
            temperature: logits are divided by it before the softmax.

        Returns:
            (log_probs, entropy), both float32 [B, T - 1]: position t scores input_ids[:, t + 1].
        """
        ...
