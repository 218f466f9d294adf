"""verl's rollout-correction and debug metrics (domain.mismatch.rollout_correction, debug_metrics)
against a plain-torch computation of the same formulas, sequence by sequence over the selected
tokens (docs/refit.md#verls-rollout-correction-metrics)."""

from __future__ import annotations

import math

import pytest
import torch

from domain.errors import MismatchInputError
from domain.mismatch import debug_metrics, rollout_correction, verl_metrics

B = 20.0  # verl's SAFETY_BOUND


def _batch(seed: int = 3, scale: float = 0.4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 11, generator=g, dtype=torch.float64) * 4
    new = old + torch.randn(4, 11, generator=g, dtype=torch.float64) * scale
    mask = torch.rand(4, 11, generator=g) > 0.3
    mask[:, 0] = True  # every sequence has a token
    return old, new, mask


def _shifted(level: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch whose sequences' aggregate log-ratios are -1, -0.05, 0.05 and 1 (plus a little noise
    at the token level): at a threshold of 1.5 or 2, the first and the last fall outside."""
    old, new, mask = _batch(scale=0.6 if level == "token" else 0.01)
    for i, b in enumerate((-1.0, -0.05, 0.05, 1.0)):
        old[i] += b / int(mask[i].sum()) if level == "sequence" else b
    return old, new, mask


def _rows(old: torch.Tensor, new: torch.Tensor, mask: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(old[i][mask[i]], new[i][mask[i]]) for i in range(old.shape[0])]


def _clamp_exp(x: torch.Tensor | float) -> torch.Tensor:
    return torch.exp(torch.as_tensor(x, dtype=torch.float64).clamp(-B, B))


def _ref_offpolicy(old: torch.Tensor, new: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    rows = _rows(old, new, mask)
    o, n = old[mask], new[mask]
    lr = o - n
    mean_o = torch.stack([r[0].mean() for r in rows])
    mean_n = torch.stack([r[1].mean() for r in rows])
    sums = torch.stack([(r[0] - r[1]).sum() for r in rows])
    d = mean_n - mean_o
    return {
        "training_ppl": float(torch.exp(-mean_o).mean()), "training_log_ppl": float((-mean_o).mean()),
        "kl": float((n - o).mean()), "k3_kl": float((lr.exp() - lr - 1).mean()),
        "rollout_ppl": float(torch.exp(-mean_n).mean()), "rollout_log_ppl": float((-mean_n).mean()),
        "log_ppl_diff": float(d.mean()), "log_ppl_abs_diff": float(d.abs().mean()),
        "log_ppl_diff_max": float(d.max()), "log_ppl_diff_min": float(d.min()), "ppl_ratio": float(d.exp().mean()),
        "chi2_token": float((_clamp_exp(lr) ** 2).mean() - 1), "chi2_seq": float(torch.exp(2 * sums.clamp(-B, B)).mean() - 1),
    }


def _ref_weights(old: torch.Tensor, new: torch.Tensor, mask: torch.Tensor, level: str) -> list[torch.Tensor]:
    """Each sequence's weights on its selected tokens."""
    out = []
    for o, n in _rows(old, new, mask):
        lr = o - n
        if level == "token":
            out.append(_clamp_exp(lr))
        else:
            agg = lr.sum() if level == "sequence" else lr.mean()
            out.append(_clamp_exp(agg).expand(len(lr)))
    return out


def _ref_stats(name: str, per_seq: list[torch.Tensor], upper: float, lower: float, level: str,
               old: torch.Tensor, new: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    w = torch.cat(per_seq)
    c = w.clamp(lower, upper)
    seq_mean = torch.stack([s.mean() for s in per_seq])
    out = {f"{name}_mean": float(w.mean()), f"{name}_std": float(((c**2).mean() - c.mean() ** 2).clamp(min=0).sqrt()),
           f"{name}_eff_sample_size": float(1 / ((c / c.mean()) ** 2).mean()),
           f"{name}_seq_mean": float(seq_mean.mean()), f"{name}_seq_std": float(seq_mean.std()),
           f"{name}_seq_max": float(seq_mean.max()), f"{name}_seq_min": float(seq_mean.min()),
           f"{name}_seq_max_deviation": float((seq_mean - 1).abs().max()),
           f"{name}_seq_fraction_high": float((seq_mean > upper).double().mean()),
           f"{name}_seq_fraction_low": float((seq_mean < lower).double().mean())}
    if level == "token":
        out |= {f"{name}_max": float(w.max()), f"{name}_min": float(w.min()),
                f"{name}_ratio_fraction_high": float((w > upper).double().mean()),
                f"{name}_ratio_fraction_low": float((w < lower).double().mean())}
    else:
        lrs = torch.stack([(o - n).sum() if level == "sequence" else (o - n).mean() for o, n in _rows(old, new, mask)])
        out |= {f"{name}_max": float(lrs.max().clamp(max=B).exp()), f"{name}_min": float(lrs.min().exp()),
                f"{name}_ratio_fraction_high": float((lrs > math.log(upper)).double().mean()),
                f"{name}_ratio_fraction_low": float((lrs < math.log(lower)).double().mean())}
    return out


def _close(got: dict[str, float], ref: dict[str, float], prefix: str = "rollout_corr/") -> None:
    for k, v in ref.items():
        assert got[prefix + k] == pytest.approx(v, rel=1e-6, abs=1e-9), k


def test_offpolicy_metrics_match_the_formulas() -> None:
    old, new, mask = _batch()
    corr = rollout_correction(old, new, mask)
    _close(corr.metrics, _ref_offpolicy(old, new, mask))
    assert corr.weights is None and torch.equal(corr.response_mask, mask.double())
    assert corr.metrics["rollout_corr/rollout_is_veto_fraction"] == 0.0


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_is_weights_and_their_metrics(level: str) -> None:
    old, new, mask = _shifted(level)
    corr = rollout_correction(old, new, mask, rollout_is=level, rollout_is_threshold=2.0)
    per_seq = _ref_weights(old, new, mask, level)
    _close(corr.metrics, _ref_stats("rollout_is", per_seq, 2.0, 0.5, level, old, new, mask))
    assert corr.weights is not None
    assert torch.allclose(corr.weights[mask], torch.cat(per_seq).clamp(max=2.0), rtol=1e-12)  # truncated (TIS)
    assert bool((corr.weights[~mask] == 0).all())  # padding weighs nothing
    assert float(corr.weights.max()) <= 2.0 and float(torch.cat(per_seq).max()) > 2.0  # truncation did bite


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_masked_is_rejects_outside_the_thresholds(level: str) -> None:
    old, new, mask = _shifted(level)
    corr = rollout_correction(old, new, mask, rollout_rs=level, rollout_rs_threshold=1.5)
    per_seq = _ref_weights(old, new, mask, level)
    _close(corr.metrics, _ref_stats("rollout_rs", per_seq, 1.5, 1 / 1.5, level, old, new, mask))
    kept = [((w >= 1 / 1.5) & (w <= 1.5)) for w in per_seq]
    expected = torch.zeros_like(mask, dtype=torch.float64)
    for i, k in enumerate(kept):
        expected[i][mask[i]] = k.double()
    assert torch.equal(corr.response_mask, expected)
    rejected = float((~torch.cat(kept)).double().mean())
    assert corr.metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(rejected, rel=1e-6)
    assert 0 < rejected < 1  # the case rejects some and keeps some
    seqs = float(torch.tensor([bool((~k).any()) for k in kept]).double().mean())
    assert corr.metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(seqs)


def test_veto_rejects_whole_sequences_with_one_catastrophic_token() -> None:
    old, new, mask = _batch(scale=0.1)
    old[2, 0] = new[2, 0] - 10.0  # ratio e^-10 in sequence 2
    corr = rollout_correction(old, new, mask, rollout_token_veto_threshold=1e-4)
    assert bool((corr.response_mask[2] == 0).all())
    assert torch.equal(corr.response_mask[[0, 1, 3]], mask[[0, 1, 3]].double())
    assert corr.metrics["rollout_corr/rollout_is_veto_fraction"] == 0.25
    assert corr.metrics["rollout_corr/rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / int(mask.sum()))


def test_batch_normalized_weights_average_one() -> None:
    old, new, mask = _batch(scale=0.3)
    corr = rollout_correction(old, new, mask, rollout_is="token", rollout_is_batch_normalize=True)
    assert corr.weights is not None
    assert float(corr.weights[mask].mean()) == pytest.approx(1.0, rel=1e-7)
    assert corr.metrics["rollout_corr/rollout_is_batch_norm_factor"] != 1.0


def test_debug_metrics_match_the_formulas() -> None:
    old, new, mask = _batch()
    got = debug_metrics(old, new, mask)
    o, n = old[mask], new[mask]
    for name, d in (("probs", (o.exp() - n.exp()).abs()), ("logprobs", (o - n).abs())):
        assert got[f"training/rollout_{name}_diff_max"] == float(d.max())
        assert got[f"training/rollout_{name}_diff_mean"] == pytest.approx(float(d.mean()), rel=1e-12)
        assert got[f"training/rollout_{name}_diff_std"] == pytest.approx(float(d.std()), rel=1e-12)
    p, q = o.exp(), n.exp()
    pearson = float(((p - p.mean()) * (q - q.mean())).sum() / ((p - p.mean()).norm() * (q - q.mean()).norm()))
    assert got["training/rollout_actor_probs_pearson_corr"] == pytest.approx(pearson, rel=1e-9)


def test_identical_log_probs_give_zero_mismatch_and_unit_weights() -> None:
    old = -torch.rand(3, 8) * 3
    m = verl_metrics(old, old.clone(), rollout_rs="token")
    assert m["rollout_corr/k3_kl"] == 0.0 and m["rollout_corr/kl"] == 0.0
    assert m["training/rollout_logprobs_diff_mean"] == 0.0
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, rel=1e-6)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0


def test_float32_input_agrees_with_float64_and_the_section_9_k3() -> None:
    from domain.mismatch import mismatch_metrics

    old, new, mask = _batch()
    m32 = verl_metrics(old.float(), new.float(), mask)
    m64 = verl_metrics(old, new, mask)
    assert m32["rollout_corr/k3_kl"] == pytest.approx(m64["rollout_corr/k3_kl"], rel=1e-4)
    assert m64["rollout_corr/k3_kl"] == pytest.approx(mismatch_metrics(old, new, mask).k3_kl, rel=1e-7)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"rollout_is": "geometric"}, "rollout_is 'geometric' is not a level"),
    ({"rollout_rs": "batch"}, "rollout_rs 'batch' is not a level"),
    ({"rollout_is": "token", "rollout_is_threshold": 0.0}, "rollout_is_threshold must be positive"),
    ({"rollout_token_veto_threshold": -1.0}, "rollout_token_veto_threshold must be positive"),
])
def test_bad_settings_raise_typed_errors(kwargs: dict[str, object], match: str) -> None:
    old, new, mask = _batch()
    with pytest.raises(MismatchInputError, match=match):
        rollout_correction(old, new, mask, **kwargs)  # type: ignore[arg-type]


def test_bad_inputs_raise_typed_errors() -> None:
    with pytest.raises(MismatchInputError, match="selects no token"):
        rollout_correction(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(MismatchInputError, match=r"\[batch, tokens\]"):
        rollout_correction(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4))
    with pytest.raises(MismatchInputError, match="NaN"):
        debug_metrics(torch.zeros(3), torch.tensor([0.0, float("inf"), 0.0]))
