"""Activation fake-quantization: per token, matching the weight codecs applied row by row, with a
straight-through gradient."""

from __future__ import annotations

import pytest
import torch

from domain.quant.codecs import dequantize_weight, fake_quantize_activation, quantize_weight
from domain.quant.formats import MXFP4, MXFP8, NVFP4, ActivationScheme


def test_nvfp4_per_token_uses_one_global_scale_per_token() -> None:
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16) * torch.tensor([1.0, 100.0, 0.01]).view(1, 3, 1)
    out = fake_quantize_activation(ActivationScheme.NVFP4_PER_TOKEN, x)
    rows = x.reshape(-1, 64)
    expected = torch.stack([dequantize_weight(quantize_weight(NVFP4, r[None]), x.dtype)[0] for r in rows])
    assert torch.equal(out.reshape(-1, 64), expected)


def test_nvfp4_static_uses_the_given_scale() -> None:
    x = torch.randn(5, 32)
    gs = torch.tensor([7.0])
    out = fake_quantize_activation(ActivationScheme.NVFP4_STATIC, x, global_scale=gs)
    assert torch.equal(out, dequantize_weight(quantize_weight(NVFP4, x, global_scale=gs)))


@pytest.mark.parametrize(("scheme", "fmt"), [(ActivationScheme.MXFP8, MXFP8), (ActivationScheme.MXFP4, MXFP4)])
def test_mx_activations_match_the_weight_codec(scheme, fmt) -> None:
    x = torch.randn(4, 6, 96)
    out = fake_quantize_activation(scheme, x)
    assert torch.equal(out.reshape(-1, 96), dequantize_weight(quantize_weight(fmt, x.reshape(-1, 96))))


def test_fp8_groups_of_128_per_token() -> None:
    x = torch.randn(3, 300)
    out = fake_quantize_activation(ActivationScheme.FP8_GROUP_128, x)
    for t in range(3):
        for g in range(0, 300, 128):
            grp = x[t, g:g + 128]
            s = grp.abs().max() / 448
            ref = (grp / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
            assert torch.equal(out[t, g:g + 128], ref)


def test_gradient_passes_straight_through() -> None:
    x = torch.randn(4, 64, requires_grad=True)
    y = fake_quantize_activation(ActivationScheme.NVFP4_PER_TOKEN, x)
    g = torch.randn(4, 64)
    y.backward(g)
    assert torch.equal(x.grad, g)


def test_none_scheme_is_the_identity() -> None:
    x = torch.randn(3, 7)
    assert fake_quantize_activation(ActivationScheme.NONE, x) is x
