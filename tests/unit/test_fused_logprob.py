"""Fused log-prob/entropy against a plain log_softmax computation written here from the spec."""

from __future__ import annotations

import math

import pytest
import torch

from domain.errors import InvalidTemperature, InvalidTensor, RefitError, UnsupportedDtype
from domain.forward.fused_logprob import (
    DEFAULT_CHUNK_BYTES,
    IGNORE_INDEX,
    auto_chunk_size,
    fused_logprob_entropy,
    reference_logprob_entropy,
)

T, H, V = 37, 24, 101


def plain(h, w, y, tau, ignore_index=IGNORE_INDEX, acc=torch.float32):
    """log p(label) and entropy from full logits: the spec, in plain torch."""
    logp_all = torch.log_softmax((h @ w.T).to(acc) / tau, dim=-1)
    keep = y != ignore_index
    lp = logp_all.gather(-1, torch.where(keep, y, 0).unsqueeze(-1)).squeeze(-1) * keep
    ent = -(logp_all.exp() * logp_all).sum(-1) * keep
    return lp, ent


def inputs(dtype=torch.float32, n=T, ignore=(3, 20)):
    h = torch.randn(n, H, dtype=dtype, requires_grad=True)
    w = (torch.randn(V, H, dtype=dtype) * 0.5).requires_grad_()
    y = torch.randint(0, V, (n,))
    for i in ignore:
        if i < n:
            y[i] = IGNORE_INDEX
    return h, w, y


def loss(lp, ent):
    # Different upstream gradients per token and per output, so both paths of the backward count.
    coef = torch.linspace(-1.0, 2.0, lp.numel(), dtype=lp.dtype).reshape(lp.shape)
    return (lp * coef).sum() + (ent * coef.flip(-1)).sum() * 0.5


@pytest.mark.parametrize("tau", [0.5, 1.0, 1.7])
@pytest.mark.parametrize("chunk", [1, 5, 16, T, 100])
def test_fp32_values_and_gradients_match_plain(tau, chunk):
    h, w, y = inputs()
    lp, ent = fused_logprob_entropy(h, w, y, temperature=tau, chunk_size=chunk)
    rlp, rent = plain(h, w, y, tau)
    assert lp.dtype == ent.dtype == torch.float32
    assert (lp - rlp).abs().max() < 1e-5
    assert (ent - rent).abs().max() < 1e-5
    g = torch.autograd.grad(loss(lp, ent), (h, w))
    rg = torch.autograd.grad(loss(rlp, rent), (h, w))
    for a, b in zip(g, rg, strict=True):
        assert a.dtype == b.dtype
        assert (a - b).abs().max() <= 2e-5 * b.abs().max()


@pytest.mark.parametrize("chunk", [3, 8])
def test_float64_gradients_match_to_rounding_and_pass_gradcheck(chunk):
    h, w, y = inputs(torch.float64)
    lp, ent = fused_logprob_entropy(h, w, y, temperature=0.8, chunk_size=chunk)
    rlp, rent = plain(h, w, y, 0.8, acc=torch.float64)
    assert (lp - rlp).abs().max() < 1e-12 and (ent - rent).abs().max() < 1e-12
    g = torch.autograd.grad(loss(lp, ent), (h, w))
    rg = torch.autograd.grad(loss(rlp, rent), (h, w))
    for a, b in zip(g, rg, strict=True):
        assert (a - b).abs().max() < 1e-11
    small = [t.detach()[:6, :5].clone().requires_grad_() for t in (h, w)]
    assert torch.autograd.gradcheck(
        lambda a, b: fused_logprob_entropy(a, b, y[:6] % 5, temperature=0.8, chunk_size=4), small
    )


def test_ignored_tokens_are_zero_and_carry_no_gradient():
    h, w, y = inputs(ignore=(0, 4, 5))
    lp, ent = fused_logprob_entropy(h, w, y, chunk_size=4)
    assert torch.all(lp[[0, 4, 5]] == 0) and torch.all(ent[[0, 4, 5]] == 0)
    assert torch.all(lp[1:4] < 0) and torch.all(ent[1:4] > 0)
    (gh,) = torch.autograd.grad((lp + ent).sum(), h)
    assert torch.all(gh[[0, 4, 5]] == 0)
    assert gh[1].abs().sum() > 0


def test_custom_ignore_index_and_leading_shape_kept():
    h = torch.randn(2, 9, H)
    w = torch.randn(V, H)
    y = torch.randint(0, V, (2, 9))
    y[1, -1] = V  # one past the vocabulary, used here as the ignore value
    lp, ent = fused_logprob_entropy(h, w, y, ignore_index=V, chunk_size=4)
    rlp, rent = plain(h, w, y, 1.0, ignore_index=V)
    assert lp.shape == ent.shape == (2, 9)
    assert (lp - rlp).abs().max() < 1e-5 and (ent - rent).abs().max() < 1e-5
    assert lp[1, -1] == 0


def test_bf16_inputs_within_documented_bounds():
    h, w, y = (t.detach() for t in inputs())
    hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    lp, ent = fused_logprob_entropy(hb, wb, y, temperature=0.7, chunk_size=6)
    assert lp.dtype == torch.float32
    # Same bf16 logits, fp32 softmax: only the reduction order differs.
    rlp, rent = plain(hb, wb, y, 0.7)
    assert (lp - rlp).abs().max() < 1e-5 and (ent - rent).abs().max() < 1e-5
    # Against fp32 math on the upcast inputs: bounded by the bf16 rounding of the logits.
    flp, fent = plain(hb.float(), wb.float(), y, 0.7)
    zmax = ((hb.detach().float() @ wb.detach().float().T) / 0.7).abs().max()
    bound = 2.0**-7 * float(zmax)
    assert (lp - flp).abs().max() <= bound and (ent - fent).abs().max() <= bound
    g = torch.autograd.grad(loss(lp, ent), (hb, wb))
    assert g[0].dtype == g[1].dtype == torch.bfloat16
    rg = torch.autograd.grad(loss(rlp, rent), (hb, wb))
    for a, b in zip(g, rg, strict=True):
        assert (a.float() - b.float()).abs().max() <= 1e-2 * b.float().abs().max()


def test_gradient_through_one_output_only_and_frozen_weight():
    h, w, y = inputs()
    w.requires_grad_(False)
    _, ent = fused_logprob_entropy(h, w, y, chunk_size=10)
    (gh,) = torch.autograd.grad(ent.sum(), h)
    _, rent = plain(h, w, y, 1.0)
    (rgh,) = torch.autograd.grad(rent.sum(), h)
    assert (gh - rgh).abs().max() <= 2e-5 * rgh.abs().max()


def test_library_reference_agrees_with_spec():
    h, w, y = inputs()
    a = reference_logprob_entropy(h, w, y, temperature=1.3)
    b = plain(h, w, y, 1.3)
    for x, r in zip(a, b, strict=True):
        assert torch.equal(x, r)


def test_empty_input_gives_empty_outputs():
    h = torch.randn(0, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    lp, ent = fused_logprob_entropy(h, w, torch.zeros(0, dtype=torch.long))
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert w.grad is not None and torch.all(w.grad == 0)


def test_auto_chunk_size_fits_the_budget():
    c = auto_chunk_size(151936)
    assert c * 151936 * 4 <= DEFAULT_CHUNK_BYTES < (c + 1) * 151936 * 4
    assert auto_chunk_size(1000, chunk_bytes=4000 * 7) == 7
    assert auto_chunk_size(10**12) == 1


@pytest.mark.parametrize("tau", [0.0, -1.0, math.nan, math.inf, True, "1.0"])
def test_bad_temperature_is_a_typed_error(tau):
    h, w, y = inputs()
    with pytest.raises(InvalidTemperature, match="temperature"):
        fused_logprob_entropy(h, w, y, temperature=tau)
    assert issubclass(InvalidTemperature, (RefitError, ValueError))


def test_bad_inputs_are_typed_errors_naming_the_tensor():
    h, w, y = inputs()
    with pytest.raises(InvalidTensor, match=r"'labels'.*outside the vocabulary"):
        fused_logprob_entropy(h, w, torch.full((T,), V))
    with pytest.raises(InvalidTensor, match=r"'labels'.*does not match"):
        fused_logprob_entropy(h, w, y[:-1])
    with pytest.raises(InvalidTensor, match="'weight'"):
        fused_logprob_entropy(h, w[:, :-1], y)
    with pytest.raises(UnsupportedDtype, match="'weight'"):
        fused_logprob_entropy(h, w.double(), y)
    with pytest.raises(UnsupportedDtype, match="'labels'"):
        fused_logprob_entropy(h, w, y.float())
    with pytest.raises(InvalidTensor, match="'chunk_size'"):
        fused_logprob_entropy(h, w, y, chunk_size=0)
