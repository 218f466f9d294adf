"""The element rules, written from the spec (docs/formats.md#element-rules): the worked ties of the
docs, zero and tiny blocks, the MX exponent rule each format takes under each rule, and the
exact ceiling against the float log2 vLLM's MXFP8 quantizer uses, for every bf16 and fp16 maximum.
The comparisons with vLLM's own functions are in tests/vllm/ (they need its environment)."""

from __future__ import annotations

import pytest
import torch

from domain.quant.codecs import dequantize_weight, nvfp4_global_scale, quantize_weight
from domain.quant.codecs.elements import e2m1_values, unpack_fp4
from domain.quant.codecs.mx import e8m0_rceil
from domain.quant.formats import BF16, FP8_BLOCK, MXFP4, MXFP8, NVFP4, ElementRule, MxScaleRule
from tests.codecs.matrix import real_shaped

ENGINE, CT = ElementRule.ENGINE, ElementRule.COMPRESSED_TENSORS


def test_the_fp8_block_tie_of_the_docs() -> None:
    w = torch.zeros(128, 128, dtype=torch.bfloat16)
    w[0, 0] = 0.765625  # amax: scale = 0.765625 / 448 = 7 x 2^-12, exact
    w[0, 1] = 0.0213623046875  # x / scale = 12.5 exactly
    got = {r: quantize_weight(FP8_BLOCK, w, numerics=r).tensors for r in ElementRule}
    for r in ElementRule:
        assert got[r]["weight_scale"].item() == 0.001708984375
    assert got[CT]["weight"][0, 1].float().item() == 12.0  # the division hits the tie: even mantissa
    assert got[ENGINE]["weight"][0, 1].float().item() == 13.0  # the reciprocal product lands above it
    scale = torch.tensor(0.001708984375)
    assert (w[0, 1].float() / scale).item() == 12.5
    assert (w[0, 1].float() * (1.0 / scale)).item() == 12.500000953674316


def test_the_nvfp4_tie_of_the_docs() -> None:
    w = real_shaped(256, 512, 4)
    gs = nvfp4_global_scale(w)
    assert round(gs.item(), 3) == 1737.697
    values = {r: e2m1_values(unpack_fp4(quantize_weight(NVFP4, w, numerics=r).tensors["weight_packed"]))
              for r in ElementRule}
    scale = quantize_weight(NVFP4, w).tensors["weight_scale"].float()
    hits = (w.float() == 0.01007080078125) & (scale.repeat_interleave(16, -1) == 14.0)
    assert bool(hits.any())
    assert bool((values[CT][hits] == 1.0).all()) and bool((values[ENGINE][hits] == 1.5).all())


def test_zero_and_tiny_blocks_follow_each_rules_floor() -> None:
    w = torch.zeros(128, 256)
    w[:, 128:] = torch.randn(128, 128) * 1e-6  # a block below the engine's 1e-4 amax floor
    eng, ct = (quantize_weight(FP8_BLOCK, w, numerics=r) for r in (ENGINE, CT))
    assert eng.tensors["weight_scale"][0, 0].item() == (torch.tensor(1e-4) / 448.0).item()
    assert eng.tensors["weight_scale"][0, 1] == eng.tensors["weight_scale"][0, 0]
    assert ct.tensors["weight_scale"][0, 0].item() == torch.finfo(torch.float32).eps
    assert ct.tensors["weight_scale"][0, 1].item() == (w[:, 128:].abs().max() / 448).item()
    for q in (eng, ct):
        assert torch.equal(dequantize_weight(q)[:, :128], torch.zeros(128, 128))


def test_nvfp4_zero_tensor_and_zero_blocks() -> None:
    zero = torch.zeros(8, 32)
    eng, ct = (quantize_weight(NVFP4, zero, numerics=r) for r in (ENGINE, CT))
    want = (2688.0 / torch.tensor([1e-8])).item()  # amax floored at 1e-8, then 2688 / amax
    assert eng.tensors["weight_global_scale"].item() == want and ct.tensors["weight_global_scale"].item() == 1.0
    assert bool((eng.tensors["weight_scale"].float() == 0).all())
    assert bool((ct.tensors["weight_scale"].float() == 0.125).all())
    for q in (eng, ct):
        assert torch.equal(dequantize_weight(q), zero)
    w = torch.randn(4, 32)
    w[:, :16] = 0.0
    eng = quantize_weight(NVFP4, w, numerics=ENGINE).tensors["weight_scale"].float()
    assert bool((eng[:, 0] == 0).all()) and bool((eng[:, 1] > 0).all())


@pytest.mark.parametrize(("fmt", "numerics", "override", "want"), [
    (MXFP8, ENGINE, None, MxScaleRule.RCEIL),
    (MXFP4, ENGINE, None, MxScaleRule.EVEN),
    (MXFP8, CT, None, MxScaleRule.EVEN),
    (MXFP4, CT, None, MxScaleRule.EVEN),
    (MXFP4, ENGINE, MxScaleRule.RCEIL, MxScaleRule.RCEIL),
    (MXFP8, CT, MxScaleRule.RCEIL, MxScaleRule.RCEIL),
    (FP8_BLOCK, ENGINE, MxScaleRule.RCEIL, None),
    (NVFP4, CT, None, None),
])
def test_each_format_takes_its_exponent_rule(fmt, numerics, override, want) -> None:
    assert fmt.scale_rule(numerics, override) is want


def test_the_default_exponent_rule_is_the_formats_engine_rule() -> None:
    w = torch.randn(64, 256, dtype=torch.bfloat16)
    for fmt in (MXFP8, MXFP4):
        rule = fmt.scale_rule(ENGINE)
        assert torch.equal(quantize_weight(fmt, w).tensors["weight_scale"],
                           quantize_weight(fmt, w, scale_rule=rule).tensors["weight_scale"])
    rceil = quantize_weight(MXFP4, w, scale_rule=MxScaleRule.RCEIL).tensors["weight_scale"]
    assert not torch.equal(quantize_weight(MXFP4, w).tensors["weight_scale"], rceil)


def test_every_quantized_format_states_both_rules() -> None:
    for fmt in (FP8_BLOCK, MXFP8, MXFP4, NVFP4):
        assert [r.rule for r in fmt.rules] == [ENGINE, CT]
        assert all(r.formula and r.reference for r in fmt.rules)
    assert BF16.rule_spec(ENGINE) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("elem_max", [448.0, 6.0])
def test_exact_ceiling_equals_vllms_float_log2_for_every_16_bit_maximum(dtype: torch.dtype, elem_max: float) -> None:
    bits = torch.arange(0, 0x7C00 if dtype is torch.float16 else 0x7F80, dtype=torch.int32).to(torch.int16)
    amax = bits.view(dtype).float()  # every non-negative finite value
    assert bool(torch.isfinite(amax).all())
    # vLLM's _mxfp8_e4m3_quantize_torch: ceil(log2(clamp(amax, tiny) / max)) + 127, clamped to [0, 254]
    theirs = (torch.ceil(torch.log2(amax.clamp(min=torch.finfo(torch.float32).tiny) / elem_max)) + 127).clamp(0, 254)
    assert torch.equal(e8m0_rceil(amax, elem_max), theirs.to(torch.int32))


def test_a_float32_maximum_just_above_a_power_of_two_is_where_they_part() -> None:
    # amax / 448 = 2^-5 x (1 + 2^-23): the exact ceiling is -4; a float32 log2 rounds to -5.
    amax = torch.tensor([448.0 * 2**-5]) * (1 + 2**-23)
    descale = amax / 448.0
    assert torch.ceil(torch.log2(descale)).item() == -5.0
    assert e8m0_rceil(amax, 448.0).item() == 127 - 4
