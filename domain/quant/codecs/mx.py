"""MX formats (MXFP8, MXFP4): E4M3 or E2M1 elements, one E8M0 scale per 32 elements along K.

Two exponent rules (ARCHITECTURE.md section 3):

- rceil (default; Transformer Engine, ModelOpt, vLLM online, torchao RCEIL):
  e = clamp(ceil(log2(amax / elem_max)) + 127, 0, 254), the ceiling taken exactly (as the
  hardware's round-up conversion to ue8m0 does). Elements = x * 2^(127 - e), except that a block
  with e = 0 is multiplied by 1 (Transformer Engine's reciprocal rule), which flushes it to zero.
- even (compressed-tensors, llm-compressor): e = 127 + floor(log2(round_up_pow2(amax))) - emax,
  round_up_pow2 rounding a mantissa of 1.75 or more up; clamped to [0, 254]. Elements =
  x / 2^(e - 127).
"""

from __future__ import annotations

import torch

from domain.quant.codecs import compile as kernels
from domain.quant.codecs.checks import check_finite_amax
from domain.quant.codecs.elements import e2m1_codes, e2m1_values, pack_fp4, to_e4m3, unpack_fp4
from domain.quant.formats import E8M0_EXPONENT_BIAS, ElementType, MxScaleRule

MX_BLOCK = 32
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
    """Biased E8M0 exponent (int32) by compressed-tensors' rule, from float32 block maxima."""
    bits = amax.view(torch.int32)
    pow2_bits = (bits + _ROUND_175) & _F32_EXP_MASK
    floor_log2 = (pow2_bits >> 23) - 127  # exponent of the rounded power of two
    biased = (floor_log2 + E8M0_EXPONENT_BIAS - elem_emax).clamp(0, 254)
    # A maximum that rounds to zero (zero, or a tiny subnormal) has log2 = -inf: exponent 0.
    return torch.where(pow2_bits == 0, 0, biased).to(torch.int32)


def _exp2(e: torch.Tensor) -> torch.Tensor:
    return torch.exp2(e.to(torch.float32))


def _quantize_kernel(
    w: torch.Tensor, element: ElementType, rule: MxScaleRule
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = w.float().reshape(*w.shape[:-1], w.shape[-1] // MX_BLOCK, MX_BLOCK)
    amax = x.abs().amax(dim=-1, keepdim=True)
    if rule is MxScaleRule.RCEIL:
        e = e8m0_rceil(amax, element.max)
        rcp = torch.where(e == 0, 1.0, _exp2(E8M0_EXPONENT_BIAS - e))
        scaled = x * rcp
    else:
        e = e8m0_even(amax, element.emax)
        scaled = x / _exp2(e - E8M0_EXPONENT_BIAS)
    scaled = scaled.clamp(-element.max, element.max).reshape(w.shape)
    elements = to_e4m3(scaled) if element is ElementType.E4M3 else pack_fp4(e2m1_codes(scaled))
    return elements, e.to(torch.uint8).squeeze(-1), amax


def quantize(
    w: torch.Tensor, name: str, element: ElementType, rule: MxScaleRule
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [..., K] along K in blocks of 32.

    Args:
        w: the tensor (any float dtype; computed in float32); K must be a multiple of 32.
        name: the tensor's name, for errors.
        element: E4M3 (MXFP8) or E2M1 (MXFP4).
        rule: the exponent rule.

    Returns:
        (elements, scale_e8m0): e4m3 [..., K] or packed uint8 [..., K/2], and uint8 [..., K/32].
    """
    elements, scale, amax = kernels.run(_quantize_kernel, w, element, rule)
    check_finite_amax(amax, name)
    return elements, scale


def dequantize(elements: torch.Tensor, scale_e8m0: torch.Tensor, element: ElementType) -> torch.Tensor:
    """float32 [..., K] = elements x 2^(e - 127)."""
    values = elements.float() if element is ElementType.E4M3 else e2m1_values(unpack_fp4(elements))
    x = values.reshape(*values.shape[:-1], values.shape[-1] // MX_BLOCK, MX_BLOCK)
    scale = _exp2(scale_e8m0.to(torch.int32) - E8M0_EXPONENT_BIAS).unsqueeze(-1)
    return (x * scale).reshape(values.shape)
