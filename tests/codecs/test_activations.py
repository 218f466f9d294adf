"""Activation fake-quantization: per token, matching the weight codecs applied row by row, with a
straight-through gradient."""

from __future__ import annotations

import pytest
import torch

from domain.quant.codecs import dequantize_weight, fake_quantize_activation, quantize_weight
from domain.quant.codecs.activations import nvfp4_per_token, nvfp4_per_token_dequantize
from domain.quant.formats import MXFP4, MXFP8, NVFP4, ActivationScheme, ElementRule


def _cast_to_fp4(x: torch.Tensor) -> torch.Tensor:
    """FlashInfer's test helper `cast_to_fp4`: E2M1 round-to-nearest-even by thresholds."""
    sign, x = torch.sign(x), torch.abs(x).clone()
    x[(x >= 0.0) & (x <= 0.25)] = 0.0
    x[(x > 0.25) & (x < 0.75)] = 0.5
    x[(x >= 0.75) & (x <= 1.25)] = 1.0
    x[(x > 1.25) & (x < 1.75)] = 1.5
    x[(x >= 1.75) & (x <= 2.5)] = 2.0
    x[(x > 2.5) & (x < 3.5)] = 3.0
    x[(x >= 3.5) & (x <= 5.0)] = 4.0
    x[x > 5.0] = 6.0
    return x * sign


def _flashinfer_per_token(x: torch.Tensor) -> torch.Tensor:
    """A literal port of nvfp4QuantAndPerTokenScaleKernel (fast-math path) with the base scale vLLM's
    quantize_nvfp4_per_token_input passes (1 / (448 * 6), as the kernel's float32), one token and one
    16-value block at a time, decoded as the GEMM does: e2m1 * SF * perTokenScale."""
    f32 = torch.float32
    scale_inv = torch.tensor(1.0 / (448.0 * 6.0), dtype=f32)
    rcp6 = torch.tensor(1.0, dtype=f32) / torch.tensor(6.0, dtype=f32)
    out = torch.empty(x.shape, dtype=f32)
    for t in range(x.shape[0]):
        row = x[t].to(f32)
        row_amax = row.abs().max()
        per_token_scale = row_amax * scale_inv
        encode = torch.tensor(1.0, dtype=f32) / per_token_scale
        for b in range(0, x.shape[1], 16):
            vec = row[b:b + 16]
            vec_max = vec.abs().max()
            if vec_max == 0:
                out[t, b:b + 16] = 0.0
                continue
            sf = (encode * (vec_max * rcp6)).to(torch.float8_e4m3fn).to(f32)
            output_scale = torch.tensor(1.0, dtype=f32) / (sf * (torch.tensor(1.0, dtype=f32) / encode))
            e2m1 = _cast_to_fp4(torch.clamp(vec * output_scale, -6.0, 6.0))
            out[t, b:b + 16] = e2m1 * sf * per_token_scale
    return out


def test_nvfp4_per_token_is_flashinfers_per_token_kernel_as_vllm_calls_it() -> None:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 128, generator=g) * torch.tensor([1.0, 100.0, 0.01, 3e-3, 7.0, 1.0]).view(6, 1))
    x[5] = 0.0  # an all-zero token decodes to zeros
    x[4, 16:32] = 0.0  # and an all-zero block
    x = x.to(torch.bfloat16)
    want = _flashinfer_per_token(x)
    packed, scale, per_token_scale = nvfp4_per_token(x)
    got = nvfp4_per_token_dequantize(packed, scale, per_token_scale)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(per_token_scale.squeeze(-1), x.float().abs().amax(-1) * torch.tensor(1 / 2688.0))
    fake = fake_quantize_activation(ActivationScheme.NVFP4_PER_TOKEN, x)
    assert torch.equal(fake.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))


def test_nvfp4_per_token_differs_from_a_global_scale_of_2688_over_the_token_maximum() -> None:
    # The per-token decode scale is amax * (1 / 2688) and the encode scale its reciprocal, not
    # 2688 / amax: on real activations the two orders give other bits on some tokens.
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ours = fake_quantize_activation(ActivationScheme.NVFP4_PER_TOKEN, x)
    old = torch.stack([dequantize_weight(quantize_weight(NVFP4, r[None]), x.dtype)[0] for r in x])
    assert not torch.equal(ours, old)


def test_nvfp4_per_token_under_the_compressed_tensors_rule_uses_one_global_scale_per_token() -> None:
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16) * torch.tensor([1.0, 100.0, 0.01]).view(1, 3, 1)
    rule = ElementRule.COMPRESSED_TENSORS
    out = fake_quantize_activation(ActivationScheme.NVFP4_PER_TOKEN, x, numerics=rule)
    rows = x.reshape(-1, 64)
    expected = torch.stack([dequantize_weight(quantize_weight(NVFP4, r[None], numerics=rule), x.dtype)[0]
                            for r in rows])
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
