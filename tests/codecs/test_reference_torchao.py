"""MX rceil against torchao's RCEIL reference (`to_mx`): every scale, and every element of blocks
with a non-zero exponent, bit for bit (torchao flushes blocks with exponent 0 to zero, as
Transformer Engine does; vLLM's quantizers, and the codecs, divide them by 2^-127 like any
other); NVFP4 against torchao's NVFP4 reference, whose operation order is neither rule's,
within one E2M1 step."""

from __future__ import annotations

import pytest
import torch

from domain.quant.codecs import dequantize_weight, quantize_weight
from domain.quant.formats import MXFP4, MXFP8, NVFP4, MxScaleRule
from tests.codecs.special import special_weight

pytest.importorskip("torchao", reason="torchao is the MX RCEIL reference")
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import to_mx
from torchao.prototype.mx_formats.nvfp4_tensor import (
    nvfp4_quantize,
    per_tensor_amax_to_scale,
)

SHAPES = [(33, 64), (48, 96), (5, 320)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # torchao's to_mx takes these two
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", [MXFP8, MXFP4])
def test_mx_rceil_matches_torchao_bitwise(fmt, shape, dtype) -> None:
    w = special_weight(*shape, dtype, block=32, seed=shape[0] + shape[1])
    w = torch.where(w == 0, torch.zeros_like(w), w)  # no -0.0: torchao keeps its sign bit
    elem = torch.float8_e4m3fn if fmt is MXFP8 else torch.float4_e2m1fn_x2
    ref_scale, ref_data = to_mx(w.contiguous(), elem, 32, ScaleCalculationMode.RCEIL)
    ours = quantize_weight(fmt, w, scale_rule=MxScaleRule.RCEIL).tensors
    assert torch.equal(ours["weight_scale"], ref_scale.view(torch.uint8))
    per_block = 32 if fmt is MXFP8 else 16  # bytes of elements per block
    got = ours[fmt.weight_name].view(torch.uint8).reshape(shape[0], -1, per_block)
    want = ref_data.view(torch.uint8).reshape(shape[0], -1, per_block)
    normal = ours["weight_scale"] > 0
    assert bool((~normal).any()) and bool(normal.any())  # special_weight has both kinds of block
    assert torch.equal(got[normal], want[normal])
    negative_zero = 0x80 if fmt is MXFP8 else 0x88  # torchao's flush keeps each element's sign
    assert bool(((want[~normal] & (0xFF ^ negative_zero)) == 0).all())


def test_nvfp4_close_to_torchao_reference() -> None:
    w = torch.randn(64, 128, dtype=torch.bfloat16)
    pts = per_tensor_amax_to_scale(w.float().abs().amax())
    ref_scale, ref_packed = nvfp4_quantize(w, 16, pts)
    ours = quantize_weight(NVFP4, w)
    ref_dq = _decode_torchao_nvfp4(ref_packed, ref_scale, pts)
    step = ours.tensors["weight_scale"].float().repeat_interleave(16, -1) / ours.tensors["weight_global_scale"]
    # Different operation order: elements may differ by at most one E2M1 step (2 x the block unit).
    assert ((dequantize_weight(ours) - ref_dq).abs() <= 2 * step + 1e-12).all()
    same = (ours.tensors["weight_packed"] == ref_packed.view(torch.uint8)).float().mean().item()
    assert same > 0.99


def _decode_torchao_nvfp4(packed: torch.Tensor, scale: torch.Tensor, pts: torch.Tensor) -> torch.Tensor:
    from domain.quant.codecs.elements import e2m1_values, unpack_fp4

    values = e2m1_values(unpack_fp4(packed.view(torch.uint8)))
    return values * (scale.float() * pts).repeat_interleave(16, -1)
