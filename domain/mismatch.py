"""Train-rollout mismatch metrics (docs/refit.md#mismatch-metrics).

For the trainer's ("old") and the rollout's log-probs of the same sampled tokens, on the masked
response tokens, with lr = old - rollout:

- k3 KL = mean(exp(lr) - lr - 1): the k3 estimator of KL(rollout || trainer), >= 0 per token, 0
  exactly when the log-probs are equal;
- kl = mean(rollout - old): the plain (k1) estimator, signed;
- mean |old - rollout|;
- token importance ratio exp(clamp(lr, -20, 20)), its mean and max;
- probability difference |exp(old) - exp(rollout)|, its mean and max.

Sums run in float64 so that tiny mismatches are not lost to float32 cancellation.

verl's own metrics, under verl's names (docs/refit.md#verls-rollout-correction-metrics), ported
literally from verl's rollout-correction helper (`compute_offpolicy_metrics`, the truncated IS
weights of `compute_rollout_correction_weights`, the rejection mask of
`compute_rollout_rejection_mask`, the veto) and its debug metrics
(`training/rollout_probs_diff_*`, `training/rollout_logprobs_diff_*`): `rollout_correction` and
`debug_metrics`. These compute in the log-probs' own dtype, as verl does.
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


# --- verl's rollout correction (docs/refit.md#verls-rollout-correction-metrics) ------------------

SAFETY_BOUND = 20.0  # verl's bound on exponentiated log-ratios: exp(+-20)
IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")
_PREFIX = "rollout_corr/"


def _sum(x: torch.Tensor, axis: int | None) -> torch.Tensor:
    return x.sum() if axis is None else x.sum(dim=axis)


def _masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    valid_values = torch.where(mask.bool(), values, 0.0)
    return _sum(valid_values * mask, axis)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    return _masked_sum(values, mask, axis) / (_sum(mask, axis) + 1e-8)


@attrs.frozen
class RolloutCorrection:
    """What verl's `compute_rollout_correction_and_rejection_mask` hands back.

    Attributes:
        weights: the truncated IS weights [B, T] (zero on padding), or None without `rollout_is`.
        response_mask: the response mask with rejected tokens / sequences (MIS, veto) set to 0.
        metrics: every metric, named as verl names it (`rollout_corr/k3_kl`, ...).
    """

    weights: torch.Tensor | None
    response_mask: torch.Tensor
    metrics: dict[str, float]


def _batch(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """[B, T] log-probs and a mask in their dtype; a 1-D input is one sequence."""
    m = _check(old, rollout, mask)
    if old.dim() == 1:
        old, rollout, m = old.unsqueeze(0), rollout.unsqueeze(0), m.unsqueeze(0)
    if old.dim() != 2:
        raise MismatchInputError(f"verl's metrics take [batch, tokens] log-probs, got {old.dim()} dimensions")
    if not bool(m.any()):
        raise MismatchInputError("the response mask selects no token; nothing to compare")
    if not (torch.isfinite(old[m]).all() and torch.isfinite(rollout[m]).all()):
        raise MismatchInputError("a selected log-prob is NaN or infinite; check the models' outputs")
    return old.detach(), rollout.detach(), m.to(old.dtype)


def offpolicy_metrics(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """verl's `compute_offpolicy_metrics` (unprefixed): kl, k3_kl, perplexities, chi-squared.

    Args:
        old: the trainer's log-probs [B, T].
        rollout: the rollout's log-probs [B, T].
        mask: the response mask [B, T], in the log-probs' dtype.

    Returns:
        training_ppl, training_log_ppl, kl, k3_kl, rollout_ppl, rollout_log_ppl, log_ppl_diff,
        log_ppl_abs_diff, log_ppl_diff_max, log_ppl_diff_min, ppl_ratio, chi2_token, chi2_seq.
    """
    metrics: dict[str, float] = {}
    mean_log_prob_training = _masked_mean(old, mask, axis=-1)
    metrics["training_ppl"] = torch.exp(-mean_log_prob_training).mean().item()
    metrics["training_log_ppl"] = (-mean_log_prob_training).mean().item()
    metrics["kl"] = _masked_mean(rollout - old, mask).item()
    log_ratio = old - rollout
    metrics["k3_kl"] = _masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask).item()
    mean_log_prob_rollout = _masked_mean(rollout, mask, axis=-1)
    metrics["rollout_ppl"] = torch.exp(-mean_log_prob_rollout).mean().item()
    metrics["rollout_log_ppl"] = (-mean_log_prob_rollout).mean().item()
    log_ppl_diff = mean_log_prob_rollout - mean_log_prob_training
    metrics["log_ppl_diff"] = log_ppl_diff.mean().item()
    metrics["log_ppl_abs_diff"] = log_ppl_diff.abs().mean().item()
    metrics["log_ppl_diff_max"] = log_ppl_diff.max().item()
    metrics["log_ppl_diff_min"] = log_ppl_diff.min().item()
    metrics["ppl_ratio"] = torch.exp(log_ppl_diff).mean().item()
    rho_token = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    metrics["chi2_token"] = (_masked_mean(rho_token.square(), mask) - 1.0).item()
    log_ratio_sum = torch.clamp(_masked_sum(log_ratio, mask, axis=-1), min=-SAFETY_BOUND, max=SAFETY_BOUND)
    metrics["chi2_seq"] = (torch.exp(2.0 * log_ratio_sum).mean() - 1.0).item()
    return metrics


def _level_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [B, T], the unclamped log-ratio the metrics read) at a level: per token, the
    sequence's product (`sequence`) or its geometric mean (`geometric`)."""
    if level == "token":
        return torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)), log_ratio
    agg = _masked_sum if level == "sequence" else _masked_mean
    per_seq = agg(log_ratio, mask, axis=-1).unsqueeze(-1)
    return torch.exp(torch.clamp(per_seq, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio), per_seq


def _weight_metrics(name: str, weights: torch.Tensor, for_metrics: torch.Tensor, mask: torch.Tensor, level: str,
                    upper: float, lower: float) -> dict[str, float]:
    """verl's `compute_is_metrics` (name `rollout_is`) and `compute_rs_metrics` (`rollout_rs`)."""
    metrics: dict[str, float] = {}
    log_upper = torch.log(torch.tensor(upper, device=weights.device))
    log_lower = torch.log(torch.tensor(lower, device=weights.device))
    if level != "token":
        metrics[f"{name}_max"] = torch.exp(torch.clamp(for_metrics.max(), max=SAFETY_BOUND)).item()
        metrics[f"{name}_min"] = torch.exp(for_metrics.min()).item()
        metrics[f"{name}_mean"] = _masked_mean(weights, mask).item()
        metrics[f"{name}_ratio_fraction_high"] = (for_metrics > log_upper).float().mean().item()
        metrics[f"{name}_ratio_fraction_low"] = (for_metrics < log_lower).float().mean().item()
    else:
        metrics[f"{name}_mean"] = _masked_mean(weights, mask).item()
        metrics[f"{name}_ratio_fraction_high"] = _masked_mean((weights > upper).float(), mask).item()
        metrics[f"{name}_ratio_fraction_low"] = _masked_mean((weights < lower).float(), mask).item()
        keep = mask.bool()
        metrics[f"{name}_max"] = weights.masked_fill(~keep, float("-inf")).max().item()
        metrics[f"{name}_min"] = weights.masked_fill(~keep, float("inf")).min().item()
    clamped = weights.clamp(min=lower, max=upper)
    if mask.sum() > 1:
        mean_clamped = _masked_mean(clamped, mask)
        var = _masked_mean(clamped.square(), mask) - mean_clamped.square()
        metrics[f"{name}_std"] = torch.sqrt(torch.clamp(var, min=0.0)).item()
    else:
        metrics[f"{name}_std"] = 0.0
    normalized = clamped / (_masked_mean(clamped, mask) + 1e-8)
    metrics[f"{name}_eff_sample_size"] = 1.0 / _masked_mean(normalized.square(), mask).item()
    seq_mean = _masked_mean(weights, mask, axis=-1)
    metrics[f"{name}_seq_mean"] = seq_mean.mean().item()
    metrics[f"{name}_seq_std"] = seq_mean.std().item() if seq_mean.numel() > 1 else 0.0
    metrics[f"{name}_seq_max"] = seq_mean.max().item()
    metrics[f"{name}_seq_min"] = seq_mean.min().item()
    metrics[f"{name}_seq_max_deviation"] = (seq_mean - 1.0).abs().max().item()
    metrics[f"{name}_seq_fraction_high"] = (seq_mean > upper).float().mean().item()
    metrics[f"{name}_seq_fraction_low"] = (seq_mean < lower).float().mean().item()
    return metrics


def _is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: float,
                batch_normalize: bool) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated IS weights (TIS), verl's `compute_rollout_correction_weights` on one process."""
    weights, for_metrics = _level_weights(log_ratio, mask, level)
    weights = weights * mask
    metrics = _weight_metrics("rollout_is", weights, for_metrics, mask, level, threshold, 1.0 / threshold)
    weights = weights.clamp(max=threshold)
    if batch_normalize:
        if level == "token":
            weights_mean = _masked_mean(weights, mask)
        else:
            seq_weights = _masked_mean(weights, mask, axis=-1)
            seq_mask = (mask.sum(dim=-1) > 0).to(dtype=weights.dtype)
            weights_mean = (seq_weights * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if weights_mean > 1e-8:
            weights = weights / weights_mean
            metrics["rollout_is_batch_norm_factor"] = weights_mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def _rejection(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, upper: float,
               lower: float | None) -> tuple[torch.Tensor, dict[str, float]]:
    """Masked IS (MIS): verl's `compute_rollout_rejection_mask`."""
    lower = lower if lower is not None else 1.0 / upper
    weights, for_metrics = _level_weights(log_ratio, mask, level)
    keep = ((weights >= lower) & (weights <= upper)).float()
    metrics = _weight_metrics("rollout_rs", weights, for_metrics, mask, level, upper, lower)
    metrics["rollout_rs_masked_fraction"] = _masked_mean(1 - keep, mask).item()
    if level == "token":
        seq_has_masked = _masked_sum(1 - keep, mask, axis=-1) > 0
        metrics["rollout_rs_seq_masked_fraction"] = seq_has_masked.float().mean().item()
    else:
        metrics["rollout_rs_seq_masked_fraction"] = (1 - keep[:, 0]).mean().item()
    return mask * keep, metrics


def rollout_correction(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor | None = None, *,
    rollout_is: str | None = None, rollout_is_threshold: float = 2.0, rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None, rollout_rs_threshold: float = 2.0, rollout_rs_threshold_lower: float | None = None,
    rollout_token_veto_threshold: float | None = None,
) -> RolloutCorrection:
    """verl's `compute_rollout_correction_and_rejection_mask`: IS weights, rejection, veto, metrics.

    Args:
        old_log_probs: the trainer's log-probs [B, T] (or [T]: one sequence).
        rollout_log_probs: the rollout's log-probs of the same tokens.
        mask: the response mask (bool or 0/1); None = every token.
        rollout_is: TIS level, "token" or "sequence"; None = no IS weights.
        rollout_is_threshold: the weights' upper truncation (> 0).
        rollout_is_batch_normalize: normalize the weights to mean 1 over the batch.
        rollout_rs: MIS level, "token", "sequence" or "geometric"; None = no rejection.
        rollout_rs_threshold: MIS keeps weights <= this ...
        rollout_rs_threshold_lower: ... and >= this (default 1 / rollout_rs_threshold).
        rollout_token_veto_threshold: a sequence with a token ratio below this is rejected whole.

    Returns:
        The RolloutCorrection; metrics are prefixed `rollout_corr/` as verl logs them.

    Raises:
        MismatchInputError: bad log-probs or mask, a level or threshold verl refuses.
    """
    old, rollout, m = _batch(old_log_probs, rollout_log_probs, mask)
    if rollout_is is not None and rollout_is not in IS_LEVELS:
        raise MismatchInputError(f"rollout_is {rollout_is!r} is not a level; use one of {', '.join(IS_LEVELS)}")
    if rollout_rs is not None and rollout_rs not in RS_LEVELS:
        raise MismatchInputError(f"rollout_rs {rollout_rs!r} is not a level; use one of {', '.join(RS_LEVELS)}")
    for label, value in (("rollout_is_threshold", rollout_is_threshold), ("rollout_rs_threshold", rollout_rs_threshold),
                         ("rollout_token_veto_threshold", rollout_token_veto_threshold)):
        if value is not None and not value > 0:
            raise MismatchInputError(f"{label} must be positive, got {value}")
    log_ratio = old - rollout
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None:
        weights, is_metrics = _is_weights(log_ratio, m, rollout_is, rollout_is_threshold, rollout_is_batch_normalize)
        metrics.update(is_metrics)
    kept = m.clone()
    if rollout_rs is not None:
        kept, rs_metrics = _rejection(log_ratio, m, rollout_rs, rollout_rs_threshold, rollout_rs_threshold_lower)
        metrics.update(rs_metrics)
    if rollout_token_veto_threshold is not None:
        log_veto = torch.log(torch.tensor(rollout_token_veto_threshold, device=log_ratio.device))
        catastrophic = (log_ratio < log_veto) & m.bool()
        has_catastrophic = catastrophic.any(dim=-1, keepdim=True)
        metrics["rollout_is_veto_fraction"] = has_catastrophic.float().mean().item()
        metrics["rollout_is_catastrophic_token_fraction"] = _masked_mean(catastrophic.float(), m).item()
        kept = kept * (~has_catastrophic).float()
    else:
        metrics["rollout_is_veto_fraction"] = 0.0
        metrics["rollout_is_catastrophic_token_fraction"] = 0.0
    metrics.update(offpolicy_metrics(old, rollout, m))
    return RolloutCorrection(weights, kept, {f"{_PREFIX}{k}": v for k, v in metrics.items()})


def debug_metrics(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                  mask: torch.Tensor | None = None) -> dict[str, float]:
    """verl's debug metrics of the rollout against the actor (`training/...`), over the mask.

    Args:
        old_log_probs: the trainer's log-probs.
        rollout_log_probs: the rollout's log-probs of the same tokens.
        mask: the response mask; None = every token.

    Returns:
        training/rollout_probs_diff_{max,mean,std} (|exp(old) - exp(rollout)|),
        training/rollout_logprobs_diff_{max,mean,std} (|old - rollout|) and
        training/rollout_actor_probs_pearson_corr (of the probabilities).
    """
    old, rollout, m = _batch(old_log_probs, rollout_log_probs, mask)
    keep = m.bool()
    actor_probs, rollout_probs = torch.exp(old), torch.exp(rollout)
    pearson = torch.corrcoef(torch.stack([torch.masked_select(actor_probs, keep),
                                          torch.masked_select(rollout_probs, keep)], dim=0))[0][1].item()
    out: dict[str, float] = {}
    for name, (a, b) in (("probs", (actor_probs, rollout_probs)), ("logprobs", (old, rollout))):
        diff = torch.masked_select(torch.abs(a - b), keep)
        out[f"training/rollout_{name}_diff_max"] = torch.max(diff).item()
        out[f"training/rollout_{name}_diff_mean"] = torch.mean(diff).item()
        out[f"training/rollout_{name}_diff_std"] = torch.std(diff).item() if diff.numel() > 1 else 0.0
    out["training/rollout_actor_probs_pearson_corr"] = pearson
    return out


def verl_metrics(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor | None = None, *,
                 rollout_is: str | None = "token", rollout_rs: str | None = None,
                 threshold: float = 2.0) -> dict[str, float]:
    """verl's rollout-correction metrics (TIS at `rollout_is`, MIS at `rollout_rs`, both at
    `threshold`) and its debug metrics, in one dict under verl's names.

    Args:
        old_log_probs: the trainer's log-probs.
        rollout_log_probs: the rollout's log-probs of the same tokens.
        mask: the response mask; None = every token.
        rollout_is: TIS level, or None.
        rollout_rs: MIS level, or None.
        threshold: rollout_is_threshold and rollout_rs_threshold.

    Returns:
        `rollout_corr/...` and `training/...` metrics.
    """
    corr = rollout_correction(old_log_probs, rollout_log_probs, mask, rollout_is=rollout_is,
                              rollout_is_threshold=threshold, rollout_rs=rollout_rs, rollout_rs_threshold=threshold)
    return {**corr.metrics, **debug_metrics(old_log_probs, rollout_log_probs, mask)}
