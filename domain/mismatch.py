"""Train-rollout mismatch metrics (ARCHITECTURE.md section 9).

For the trainer's ("old") and the rollout's log-probs of the same sampled tokens, on the masked
response tokens, with lr = old - rollout:

- k3 KL = mean(exp(lr) - lr - 1): the k3 estimator of KL(rollout || trainer), >= 0 per token, 0
  exactly when the log-probs are equal;
- kl = mean(rollout - old): the plain (k1) estimator, signed;
- mean |old - rollout|;
- token importance ratio exp(clamp(lr, -20, 20)), its mean and max;
- probability difference |exp(old) - exp(rollout)|, its mean and max.

Sums run in float64 so that tiny mismatches are not lost to float32 cancellation.
"""

from __future__ import annotations

import attrs
import torch

from domain.errors import MismatchInputError

LOG_RATIO_CLAMP = 20.0


@attrs.frozen
class MismatchMetrics:
    """Mismatch between trainer and rollout log-probs over the masked tokens.

    Attributes:
        tokens: number of tokens the metrics average over.
        k3_kl: mean(exp(lr) - lr - 1).
        kl: mean(rollout - old).
        mean_abs_logp_diff: mean |old - rollout|.
        importance_ratio_mean: mean of exp(clamp(lr, -20, 20)).
        importance_ratio_max: max of the same.
        prob_diff_mean: mean |exp(old) - exp(rollout)|.
        prob_diff_max: max |exp(old) - exp(rollout)|.
    """

    tokens: int
    k3_kl: float
    kl: float
    mean_abs_logp_diff: float
    importance_ratio_mean: float
    importance_ratio_max: float
    prob_diff_mean: float
    prob_diff_max: float

    def to_dict(self) -> dict[str, float | int]:
        return attrs.asdict(self)


def _check(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if old.shape != rollout.shape:
        raise MismatchInputError(
            f"trainer log-probs {tuple(old.shape)} and rollout log-probs {tuple(rollout.shape)} "
            "differ in shape; score the same token batch on both sides"
        )
    for label, t in (("trainer", old), ("rollout", rollout)):
        if not t.is_floating_point():
            raise MismatchInputError(f"{label} log-probs must be floating point, got {t.dtype}")
    if mask is None:
        return torch.ones(old.shape, dtype=torch.bool, device=old.device)
    if mask.shape != old.shape:
        raise MismatchInputError(
            f"response mask {tuple(mask.shape)} does not match the log-probs {tuple(old.shape)}"
        )
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise MismatchInputError("response mask must hold only 0 and 1")
    return mask.bool()


def mismatch_metrics(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor | None = None
) -> MismatchMetrics:
    """Compute the mismatch metrics of section 9.

    Args:
        old_log_probs: the trainer's log-probs of the sampled tokens, any shape (e.g. [B, T-1]).
        rollout_log_probs: the rollout engine's log-probs of the same tokens, same shape.
        mask: response mask of the same shape (bool, or 0/1); None = every token.

    Returns:
        MismatchMetrics over the masked tokens.

    Raises:
        MismatchInputError: shapes differ, the mask is not 0/1, no token is selected, or a
            selected log-prob is NaN or infinite.
    """
    m = _check(old_log_probs, rollout_log_probs, mask)
    old = old_log_probs.detach()[m].double()
    new = rollout_log_probs.detach()[m].double()
    if old.numel() == 0:
        raise MismatchInputError("the response mask selects no token; nothing to compare")
    if not (torch.isfinite(old).all() and torch.isfinite(new).all()):
        raise MismatchInputError("a selected log-prob is NaN or infinite; check the models' outputs")
    lr = old - new
    ratio = torch.exp(lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    prob_diff = (old.exp() - new.exp()).abs()
    return MismatchMetrics(
        tokens=int(old.numel()),
        k3_kl=float((torch.exp(lr) - lr - 1).mean()),
        kl=float((new - old).mean()),
        mean_abs_logp_diff=float(lr.abs().mean()),
        importance_ratio_mean=float(ratio.mean()),
        importance_ratio_max=float(ratio.max()),
        prob_diff_mean=float(prob_diff.mean()),
        prob_diff_max=float(prob_diff.max()),
    )
