"""Codecs against plain-torch references written from the spec (docs/formats.md#element-rules),
block by block with Python loops: FP8 block with FP32 scales and edge blocks under both element
rules, MX rceil for the dtypes torchao does not take (float16), E2M1 rounding against a
brute-force search, packing order, and per-expert quantization of 3-D tensors."""

from __future__ import annotations

import math

import pytest
import torch

from domain.quant.codecs import dequantize_weight, nvfp4_global_scale, quantize_weight
from domain.quant.codecs.elements import e2m1_codes, e2m1_values, pack_fp4, unpack_fp4
from domain.quant.formats import E2M1_VALUES, FP8_BLOCK, MXFP4, MXFP8, NVFP4, ElementRule, MxScaleRule
from tests.codecs.special import special_weight


def _fp8_block_reference(w: torch.Tensor, rule: ElementRule) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    x = w.float()
    nb, kb = math.ceil(n / 128), math.ceil(k / 128)
    scale = torch.empty(nb, kb, dtype=torch.float32)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(nb):
        for j in range(kb):
            blk = x[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]  # edge blocks are just smaller
            if rule is ElementRule.ENGINE:  # amax clamped to 1e-4, times the reciprocal
                s = torch.clamp(blk.abs().max(), min=1e-4) / 448.0
                scaled = blk * (1.0 / s)
            else:  # divided; a zero block gets float32 eps
                s = blk.abs().max() / 448.0
                if s == 0:
                    s = torch.tensor(torch.finfo(torch.float32).eps)
                scaled = blk / s
            scale[i, j] = s
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = scaled.clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


@pytest.mark.parametrize("rule", list(ElementRule))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1), (129, 257), (300, 128), (128, 1000)])
def test_fp8_block_matches_spec_reference(dtype, shape, rule) -> None:
    w = special_weight(shape[0], shape[1], dtype, block=max(1, min(128, shape[1])), seed=sum(shape))
    q = quantize_weight(FP8_BLOCK, w, numerics=rule)
    ref_q, ref_s = _fp8_block_reference(w, rule)
    assert torch.equal(q.tensors["weight_scale"], ref_s)
    assert torch.equal(q.tensors["weight"].view(torch.uint8), ref_q.view(torch.uint8))
    dq = dequantize_weight(q)
    assert torch.equal(dq, ref_q.float() * ref_s.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]])
    assert not torch.isnan(dq).any()


def _rceil_exponent(amax: float, elem_max: float) -> int:
    if amax == 0:
        return 0
    d = float(torch.tensor(amax, dtype=torch.float32) / elem_max)  # the float32 quotient
    m, e = math.frexp(d)
    return max(0, min(254, (e - 1 if m == 0.5 else e) + 127))


@pytest.mark.parametrize("rule", list(ElementRule))
@pytest.mark.parametrize("fmt", [MXFP8, MXFP4])
def test_mx_rceil_float16_matches_spec_reference(fmt, rule) -> None:
    w = special_weight(9, 96, torch.float16, block=32, seed=11)
    w[0, :4] = torch.tensor([-0.0, 0.0, -0.0, 1.0])  # the element rules encode an E2M1 -0 differently
    q = quantize_weight(fmt, w, numerics=rule, scale_rule=MxScaleRule.RCEIL)
    x = w.float().reshape(9, 3, 32)
    for r in range(9):
        for b in range(3):
            e = _rceil_exponent(float(x[r, b].abs().max()), fmt.element.max)
            assert int(q.tensors["weight_scale"][r, b]) == e
    ref_scale = torch.exp2(q.tensors["weight_scale"].float() - 127).repeat_interleave(32, -1)
    ref = (w.float() / ref_scale).clamp(-fmt.element.max, fmt.element.max)
    if fmt is MXFP8:
        assert torch.equal(q.tensors["weight"].view(torch.uint8), ref.to(torch.float8_e4m3fn).view(torch.uint8))
    else:
        codes = unpack_fp4(q.tensors["weight_packed"])
        assert torch.equal(codes, _brute_force_e2m1(ref, signed_zero=rule is ElementRule.ENGINE))
        assert codes[0, 0].item() == (8 if rule is ElementRule.ENGINE else 0)


def test_rceil_takes_the_exact_ceiling_just_above_a_power_of_two() -> None:
    # amax / 448 = 2^-3 * (1 + 2^-23) in float32: log2 in float32 rounds this to -3, the exact
    # ceiling (and the hardware's round-up conversion) gives -2.
    amax = torch.tensor(448.0 * 2**-3, dtype=torch.float32) * (1 + 2**-23)
    w = torch.zeros(1, 32)
    w[0, 0] = amax
    q = quantize_weight(MXFP8, w)
    assert int(q.tensors["weight_scale"][0, 0]) == 127 - 2


def _brute_force_e2m1(x: torch.Tensor, *, signed_zero: bool = False) -> torch.Tensor:
    grid = torch.tensor(E2M1_VALUES)
    flat = x.reshape(-1)
    out = torch.empty(flat.shape, dtype=torch.uint8)
    for i, v in enumerate(flat.tolist()):
        a = min(abs(v), 6.0)
        d = (grid - a).abs()
        best = [j for j in range(8) if d[j] == d.min()]
        code = best[0] if len(best) == 1 else next(j for j in best if j % 2 == 0)  # ties to even
        negative = math.copysign(1.0, v) < 0 if signed_zero else v < 0
        out[i] = code | (8 if negative else 0)
    return out.reshape(x.shape)


def test_e2m1_rounding_matches_brute_force_including_ties() -> None:
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    grid = torch.linspace(-8, 8, 2049).tolist()
    vals = torch.tensor(ties + [-t for t in ties] + grid + list(E2M1_VALUES) + [6.5, 7.0, 1e9, -1e9, 1e-30])
    assert torch.equal(e2m1_codes(vals), _brute_force_e2m1(vals))
    signed = torch.cat([vals, torch.tensor([-0.0, 0.0, -1e-30])])
    assert torch.equal(e2m1_codes(signed, signed_zero=True), _brute_force_e2m1(signed, signed_zero=True))


def test_e2m1_decode_covers_all_sixteen_codes() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    expected = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES])
    assert torch.equal(e2m1_values(codes), expected)


def test_fp4_packing_puts_the_first_element_in_the_low_nibble() -> None:
    codes = torch.tensor([[0x1, 0xA, 0x7, 0xF]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0xA1, 0xF7]]
    assert torch.equal(unpack_fp4(packed), codes)


def test_e4m3_saturates_instead_of_overflowing_to_nan() -> None:
    w = torch.zeros(1, 32)
    w[0, :3] = torch.tensor([1.0, 500.0, -1e6])
    for fmt, rule in ((MXFP8, MxScaleRule.EVEN), (MXFP8, MxScaleRule.RCEIL), (FP8_BLOCK, MxScaleRule.RCEIL)):
        dq = dequantize_weight(quantize_weight(fmt, w, scale_rule=rule))
        assert torch.isfinite(dq).all()


@pytest.mark.parametrize("fmt", [FP8_BLOCK, MXFP8, MXFP4, NVFP4])
def test_3d_experts_quantize_per_expert(fmt) -> None:
    experts = torch.randn(3, 40, 64, dtype=torch.bfloat16) * torch.tensor([0.1, 1.0, 10.0]).view(3, 1, 1)
    q = quantize_weight(fmt, experts)
    for e in range(3):
        one = quantize_weight(fmt, experts[e])
        for key, t in one.tensors.items():
            assert torch.equal(q.tensors[key][e].reshape(t.shape).view(torch.uint8), t.view(torch.uint8)), key
    if fmt is NVFP4:
        assert q.tensors["weight_global_scale"].shape == (3, 1)
        assert torch.equal(nvfp4_global_scale(experts), q.tensors["weight_global_scale"])
    assert torch.equal(dequantize_weight(q)[1], dequantize_weight(quantize_weight(fmt, experts[1])))


@pytest.mark.parametrize(("fmt", "low", "high"), [(MXFP8, 0.001, 0.01), (MXFP4, 0.08, 0.18)])
def test_rceil_and_even_differ_on_the_documented_share_of_blocks(fmt, low, high) -> None:
    w = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    a = quantize_weight(fmt, w, scale_rule=MxScaleRule.RCEIL).tensors["weight_scale"]
    b = quantize_weight(fmt, w, scale_rule=MxScaleRule.EVEN).tensors["weight_scale"]
    share = (a != b).float().mean().item()
    assert low < share < high


@pytest.mark.parametrize("fmt", [FP8_BLOCK, MXFP8, MXFP4, NVFP4])
@pytest.mark.parametrize("shape", [(700, 96), (2, 300, 64)])
def test_row_chunking_changes_no_bit(fmt, shape, monkeypatch) -> None:
    from domain.quant.codecs import api

    w = torch.randn(*shape, dtype=torch.bfloat16) * torch.linspace(0.1, 10, shape[-2]).unsqueeze(-1)
    whole = quantize_weight(fmt, w).tensors
    monkeypatch.setattr(api, "CHUNK_ELEMENTS", 2048)  # forces many chunks
    chunked = quantize_weight(fmt, w).tensors
    for key in whole:
        assert torch.equal(whole[key].view(torch.uint8), chunked[key].view(torch.uint8)), key
