"""MX formats (MXFP8, MXFP4): E4M3 or E2M1 elements, one E8M0 exponent per block along K.

The block is the format's (`fmt.block_size`, 1 x 32). Two exponent rules
(docs/formats.md#element-rules), chosen per format by the element rule unless
rollout.quantization.scale_rule says:

- rceil (the engine's rule for MXFP8: vLLM's online quantizer, Transformer Engine, ModelOpt,
  torchao RCEIL): e = clamp(ceil(log2(amax / elem_max)) + 127, 0, 254), the ceiling taken exactly
  (as the hardware's round-up conversion to ue8m0 does).
- even (the engine's rule for MXFP4, vLLM's Triton `downcast_to_mxfp`, and compressed-tensors'
  for both): e = 127 + floor(log2(round_up_pow2(amax))) - emax, round_up_pow2 rounding a
  mantissa of 1.75 or more up; clamped to [0, 254].

Elements = x / 2^(e - 127) under both element rules: every such power of two (2^-127 included)
is exact in float32, so dividing by it and multiplying by 2^(127 - e), as vLLM's Triton kernels
do, round to the same float. The element rules differ only in the sign of an E2M1 zero: the
engine keeps the sign bit of -0.0 (code 8), compressed-tensors stores it as +0.
"""

from __future__ import annotations

import torch

from domain.quant.codecs import compile as kernels
from domain.quant.codecs import fast_elements
from domain.quant.codecs.checks import check_finite_amax
from domain.quant.codecs.elements import e2m1_codes, e2m1_values, pack_fp4, to_e4m3, unpack_fp4
from domain.quant.formats import E8M0_EXPONENT_BIAS, ElementRule, ElementType, MxScaleRule, PrecisionFormat

_F32_EXP_MASK = 0x7F800000  # sign is zero for an amax
_ROUND_175 = 1 << 21  # adding a quarter of the leading mantissa bit carries 1.75 and up


def e8m0_rceil(amax: torch.Tensor, elem_max: float) -> torch.Tensor:
    """Biased E8M0 exponent (int32) by the rceil rule, from float32 block maxima."""
    descale = amax / elem_max
    mantissa, exponent = torch.frexp(descale)  # descale = mantissa * 2**exponent, mantissa in [0.5, 1)
    ceil_log2 = torch.where(mantissa == 0.5, exponent - 1, exponent)
    biased = (ceil_log2 + E8M0_EXPONENT_BIAS).clamp(0, 254)
    return torch.where(descale == 0, 0, biased).to(torch.int32)


def e8m0_even(amax: torch.Tensor, elem_emax: int) -> torch.Tensor:
    """Biased E8M0 exponent (int32) by the even (OCP round-to-nearest) rule, from float32 block maxima."""
    bits = amax.view(torch.int32)
    pow2_bits = (bits + _ROUND_175) & _F32_EXP_MASK
    floor_log2 = (pow2_bits >> 23) - 127  # exponent of the rounded power of two
    biased = (floor_log2 + E8M0_EXPONENT_BIAS - elem_emax).clamp(0, 254)
    # A maximum that rounds to zero (zero, or a tiny subnormal) has log2 = -inf: exponent 0.
    return torch.where(pow2_bits == 0, 0, biased).to(torch.int32)


def _exp2(e: torch.Tensor) -> torch.Tensor:
    return torch.exp2(e.to(torch.float32))


def _quantize_kernel(
    w: torch.Tensor, element: ElementType, block: int, scale_rule: MxScaleRule, rule: ElementRule, fast: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = w.float().reshape(*w.shape[:-1], w.shape[-1] // block, block)
    amax = x.abs().amax(dim=-1, keepdim=True)
    e = e8m0_rceil(amax, element.max) if scale_rule is MxScaleRule.RCEIL else e8m0_even(amax, element.emax)
    scaled = (x / _exp2(e - E8M0_EXPONENT_BIAS)).clamp(-element.max, element.max).reshape(w.shape)
    signed_zero = rule is ElementRule.ENGINE
    if element is ElementType.E4M3:
        elements = to_e4m3(scaled)
    elif fast:
        elements = fast_elements.pack_fp4(fast_elements.e2m1_codes(scaled, signed_zero=signed_zero))
    else:
        elements = pack_fp4(e2m1_codes(scaled, signed_zero=signed_zero))
    return elements, e.to(torch.uint8).squeeze(-1), amax


def quantize(
    w: torch.Tensor, name: str, fmt: PrecisionFormat, rule: ElementRule, scale_rule: MxScaleRule | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [..., K] along K in the format's blocks.

    Args:
        w: the tensor (any float dtype; computed in float32); K must be a multiple of the block.
        name: the tensor's name, for errors.
        fmt: MXFP8 or MXFP4.
        rule: the element rule.
        scale_rule: the exponent rule; None = the format's rule under `rule` (`fmt.scale_rule`).

    Returns:
        (elements, scale_e8m0): e4m3 [..., K] or packed uint8 [..., K/2], and uint8 [..., K/block].
    """
    chosen = fmt.scale_rule(rule, scale_rule)
    if chosen is None:
        raise ValueError(f"{fmt.name} is not an MX format")
    elements, scale, amax = kernels.run(_quantize_kernel, w, fmt.element, fmt.block_size[1], chosen, rule)
    check_finite_amax(amax, name)
    return elements, scale


def dequantize(elements: torch.Tensor, scale_e8m0: torch.Tensor, fmt: PrecisionFormat) -> torch.Tensor:
    """float32 [..., K] = elements x 2^(e - 127)."""
    block = fmt.block_size[1]
    values = elements.float() if fmt.element is ElementType.E4M3 else e2m1_values(unpack_fp4(elements))
    x = values.reshape(*values.shape[:-1], values.shape[-1] // block, block)
    scale = _exp2(scale_e8m0.to(torch.int32) - E8M0_EXPONENT_BIAS).unsqueeze(-1)
    return (x * scale).reshape(values.shape)
