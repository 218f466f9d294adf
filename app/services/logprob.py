"""LogProbService: per-token log-probs and entropy of the policy, as an RL trainer asks for them.

Built by `app.bootstrap.build_logprob_service`, which decides the fused-forward mode once.
"""

from __future__ import annotations

import contextlib
import time
from typing import TypeGuard

import attrs
import structlog
import torch

from domain.errors import InvalidTensor
from ports.trainer_model import TrainerModel

log = structlog.get_logger()


def is_trainer_model(model: object) -> TypeGuard[TrainerModel]:
    """Whether `model` already is a TrainerModel (it scores tokens and yields its weights)."""
    return callable(getattr(model, "log_probs", None)) and callable(getattr(model, "named_weights", None))


def _float_tensor(_: object, attribute: attrs.Attribute, value: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise InvalidTensor(attribute.name, f"expected a floating tensor, got {type(value).__name__}")


@attrs.frozen
class TokenScores:
    """Per-token scores: position t scores input_ids[:, t + 1].

    Attributes:
        log_probs: float32 [B, T - 1] log-probability of each next token.
        entropy: float32 [B, T - 1] entropy of each next-token distribution.
    """

    log_probs: torch.Tensor = attrs.field(validator=_float_tensor)
    entropy: torch.Tensor = attrs.field(validator=_float_tensor)

    def __attrs_post_init__(self) -> None:
        if self.log_probs.shape != self.entropy.shape:
            raise InvalidTensor(
                "entropy", f"shape {tuple(self.entropy.shape)} differs from log_probs {tuple(self.log_probs.shape)}"
            )

    def mean_entropy(self, mask: torch.Tensor | None = None) -> float:
        """Mean entropy over the positions where `mask` is True (all positions without a mask)."""
        if mask is None:
            return float(self.entropy.mean())
        if mask.shape != self.entropy.shape:
            raise InvalidTensor("mask", f"shape {tuple(mask.shape)} differs from {tuple(self.entropy.shape)}")
        return float(self.entropy[mask.bool()].mean())


@attrs.define
class LogProbService:
    """Scores tokens with a trainer model.

    Attributes:
        trainer: the TrainerModel (e.g. the Megatron adapter with its fused forward).
        mode: the fused-forward mode decided at build ("hook", "legacy"), or "none" for a
            trainer without one.
        source: where the mode request came from (configuration key, environment, default).
    """

    trainer: TrainerModel
    mode: str = "none"
    source: str = "default"

    def compute(
        self, input_ids: torch.Tensor, *, temperature: float = 1.0, with_grad: bool = False
    ) -> TokenScores:
        """Log-probs and entropy of every next token of `input_ids`.

        Args:
            input_ids: int64 [B, T] token ids.
            temperature: the rollout's sampling temperature (logits are divided by it).
            with_grad: keep the autograd graph (policy update); False for old/reference
                log-probs, which run without it.

        Returns:
            TokenScores with [B, T - 1] tensors.
        """
        bound = log.bind(mode=self.mode, tokens=int(input_ids.numel()), temperature=temperature)
        started = time.perf_counter()
        grad = contextlib.nullcontext() if with_grad else torch.no_grad()
        with grad:
            log_probs, entropy = self.trainer.log_probs(input_ids, temperature=temperature)
        bound.debug("log_probs", seconds=round(time.perf_counter() - started, 4))
        return TokenScores(log_probs, entropy)
