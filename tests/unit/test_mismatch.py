"""Mismatch metrics (docs/refit.md#mismatch-metrics) against a plain-Python reference."""

from __future__ import annotations

import math

import pytest
import torch

from domain.errors import MismatchInputError
from domain.mismatch import mismatch_metrics


def _reference(old: list[float], new: list[float]) -> dict[str, float]:
    lr = [o - n for o, n in zip(old, new, strict=True)]
    ratio = [math.exp(max(-20.0, min(20.0, x))) for x in lr]
    pd = [abs(math.exp(o) - math.exp(n)) for o, n in zip(old, new, strict=True)]
    n = len(lr)
    return {
        "k3_kl": sum(math.exp(x) - x - 1 for x in lr) / n,
        "kl": sum(b - a for a, b in zip(old, new, strict=True)) / n,
        "mean_abs_logp_diff": sum(abs(x) for x in lr) / n,
        "importance_ratio_mean": sum(ratio) / n,
        "importance_ratio_max": max(ratio),
        "prob_diff_mean": sum(pd) / n,
        "prob_diff_max": max(pd),
    }


def test_matches_a_plain_python_reference_on_masked_tokens():
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(3, 9, generator=g) * 5
    new = old + torch.randn(3, 9, generator=g) * 0.3
    mask = torch.rand(3, 9, generator=g) > 0.4
    m = mismatch_metrics(old, new, mask)
    ref = _reference(old[mask].double().tolist(), new[mask].double().tolist())
    assert m.tokens == int(mask.sum())
    for key, value in ref.items():
        assert getattr(m, key) == pytest.approx(value, rel=1e-12, abs=1e-15), key


def test_identical_log_probs_give_exact_zeros_and_unit_ratio():
    old = -torch.rand(4, 16) * 3
    m = mismatch_metrics(old, old.clone())
    assert m.k3_kl == 0.0 and m.kl == 0.0 and m.mean_abs_logp_diff == 0.0
    assert m.prob_diff_max == 0.0 and m.importance_ratio_mean == 1.0 and m.importance_ratio_max == 1.0


def test_k3_is_non_negative_and_grows_with_the_perturbation():
    old = -torch.rand(2000) * 4
    noise = torch.randn(2000)
    values = [mismatch_metrics(old, old + s * noise).k3_kl for s in (0.01, 0.05, 0.2)]
    assert all(v > 0 for v in values) and values == sorted(values)


def test_importance_ratio_is_clamped():
    m = mismatch_metrics(torch.tensor([0.0]), torch.tensor([-50.0]))
    assert m.importance_ratio_max == pytest.approx(math.exp(20.0))


def test_float_mask_of_zeros_and_ones_is_accepted():
    old, new = torch.zeros(2, 3), torch.full((2, 3), -0.1)
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    assert mismatch_metrics(old, new, mask).tokens == 3


@pytest.mark.parametrize(
    ("old", "new", "mask", "match"),
    [
        (torch.zeros(2, 3), torch.zeros(3, 2), None, "differ in shape"),
        (torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool), "selects no token"),
        (torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 2, dtype=torch.bool), "does not match"),
        (torch.zeros(2, 3), torch.zeros(2, 3), torch.full((2, 3), 0.5), "only 0 and 1"),
        (torch.zeros(2), torch.tensor([0.0, float("nan")]), None, "NaN or infinite"),
        (torch.zeros(2, dtype=torch.int64), torch.zeros(2), None, "floating point"),
    ],
)
def test_bad_inputs_raise_typed_errors(old, new, mask, match):
    with pytest.raises(MismatchInputError, match=match):
        mismatch_metrics(old, new, mask)
