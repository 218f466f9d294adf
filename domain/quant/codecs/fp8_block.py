"""FP8 block: E4M3 elements, one float32 scale per block (edge blocks allowed: pad, compute, crop).

The block is the format's (`FP8_BLOCK.block_size`, 128x128 for weights; activations use 1 x 128
groups). scale = amax_block / 448 in float32. The element rules (docs/formats.md#element-rules):

- engine, weights: vLLM's `per_block_cast_to_fp8` (DeepGEMM's): amax clamped to 1e-4, elements =
  e4m3(x * (1.0 / scale)). (Transformer Engine's and ModelOpt's block quantizers multiply by
  448 / amax instead, and decode with its reciprocal: a third order, docs/qat.md.) The reciprocal product
  can land on the other side of a tie: where x / scale is exactly 42, the division rounds to 40
  (the even mantissa) and the product, just above 42, to 44.
- engine, activations: vLLM's `per_token_group_quant_fp8` CUDA kernel: amax clamped to 1e-10,
  elements = e4m3(x / scale).
- compressed-tensors: elements = e4m3(x / scale); a zero block gets float32 eps as its scale (as
  `calculate_qparams` does), so that it decodes to zeros without NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from domain.quant.codecs import compile as kernels
from domain.quant.codecs.checks import check_finite_amax
from domain.quant.codecs.elements import to_e4m3
from domain.quant.formats import F8E4M3_MAX, ElementRule

FP32_EPS = torch.finfo(torch.float32).eps
WEIGHT_AMAX_FLOOR = 1e-4  # per_block_cast_to_fp8: x_amax.clamp(1e-4)
ACTIVATION_AMAX_FLOOR = 1e-10  # per_token_group_quant_fp8: eps, the start of the absmax reduction


def _blocked(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Zero-pad [..., N, K] to whole blocks and view it as [..., N/br, br, K/bc, bc]."""
    br, bc = block
    *lead, n, k = x.shape
    nb, kb = -(-n // br), -(-k // bc)
    if nb * br != n or kb * bc != k:
        x = F.pad(x, (0, kb * bc - k, 0, nb * br - n))
    return x.reshape(*lead, nb, br, kb, bc)


def _quantize_kernel(
    w: torch.Tensor, block: tuple[int, int], rule: ElementRule, activation: bool, fast: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # `fast` (the compiled path) changes nothing here: E4M3 is the float8 cast on both paths.
    *_, n, k = w.shape
    xb = _blocked(w.float(), block)
    amax = xb.abs().amax(dim=(-3, -1))
    if rule is ElementRule.ENGINE:
        scale = amax.clamp(min=ACTIVATION_AMAX_FLOOR if activation else WEIGHT_AMAX_FLOOR) / F8E4M3_MAX
        s = scale[..., :, None, :, None]
        scaled = xb / s if activation else xb * (1.0 / s)
    else:
        scale = amax / F8E4M3_MAX
        scale = torch.where(scale == 0, FP32_EPS, scale)
        scaled = xb / scale[..., :, None, :, None]
    q = to_e4m3(scaled)
    q = q.reshape(*q.shape[:-4], q.shape[-4] * q.shape[-3], q.shape[-2] * q.shape[-1])
    return q[..., :n, :k].contiguous(), scale, amax


def quantize(
    w: torch.Tensor, name: str, block: tuple[int, int], rule: ElementRule, *, activation: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [..., N, K] to (e4m3 [..., N, K], float32 scale [..., ceil(N/br), ceil(K/bc)]).

    Args:
        w: the weight or activation (any float dtype; computed in float32).
        name: the tensor's name, for errors.
        block: (rows, cols) of one scale block.
        rule: the element rule.
        activation: the engine's activation kernel's order (1x128 groups) instead of its weight
            quantizer's; the compressed-tensors rule is the same for both.

    Returns:
        The E4M3 elements and the float32 block scales.
    """
    q, scale, amax = kernels.run(_quantize_kernel, w, block, rule, activation)
    check_finite_amax(amax, name)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 [..., N, K] = e4m3 elements x their block's scale."""
    *_, n, k = q.shape
    xb = _blocked(q.float(), block)
    out = xb * scale[..., :, None, :, None]
    out = out.reshape(*out.shape[:-4], out.shape[-4] * out.shape[-3], out.shape[-2] * out.shape[-1])
    return out[..., :n, :k].contiguous()
