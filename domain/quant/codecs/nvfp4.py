"""NVFP4: E2M1 elements, one E4M3 scale per block along K, times a float32 global scale.

The block is the format's (`NVFP4.block_size`, 1 x 16). The global scale is an encode multiplier,
as compressed-tensors stores it (engines invert it): (6 * 448) / amax_tensor. The element rules
(docs/formats.md#element-rules), each in its reference's own operation order:

- engine: vLLM's `scaled_fp4_quant` kernel as its torch mirror `ref_nvfp4_quant` computes it.
  Global scale (6 * 448) / max(amax, 1e-8) (vLLM's online NVFP4 quantization); block scale =
  e4m3(global * (amax_block * (1 / 6))), 0 kept for a zero block; elements =
  E2M1(x * r(scale * r(global))) with r(t) = 1 / (t + (t == 0) * 1e8), the sign of -0 kept.
- compressed-tensors: global scale (6 * 448) / amax (1.0 for a zero tensor, never Inf); block
  scale = e4m3(global * (amax_block / 6)), a block scale that rounds to zero stored as 0.125
  (compressed-tensors' eps for e4m3); elements = E2M1(x / (scale / global)).

In torch `python_float / tensor` is `tensor.reciprocal() * python_float`, so both global scales
are the reciprocal of the maximum times 2688, as in both references.
"""

from __future__ import annotations

import torch

from domain.errors import UnsupportedShape
from domain.keys import key
from domain.quant.codecs import compile as kernels
from domain.quant.codecs import fast_elements
from domain.quant.codecs.checks import check_finite_amax
from domain.quant.codecs.elements import e2m1_codes, e2m1_values, pack_fp4, to_e4m3, unpack_fp4
from domain.quant.formats import F4E2M1_MAX, F8E4M3_MAX, NVFP4, ElementRule

E4M3_EPS = 0.125
GLOBAL_AMAX_FLOOR = 1e-8  # vLLM's online NVFP4: amax.clamp_min(1e-8)
_FP32_TINY = torch.finfo(torch.float32).tiny


def global_scale(*tensors: torch.Tensor, name: str = "weight", rule: ElementRule = ElementRule.ENGINE) -> torch.Tensor:
    """The float32 global scale shared by `tensors` (a fused group shares one).

    Args:
        tensors: [N, K] weights, or [E, N, K] expert weights (one scale per expert).
        name: for errors.
        rule: the element rule (it decides the zero-maximum case).

    Returns:
        float32 [1] for 2-D tensors, [E, 1] for 3-D ones; always finite (a zero maximum gives
        2688 / 1e-8 under engine, 1.0 under compressed-tensors).
    """
    for t in tensors:
        if t.numel() == 0:
            raise UnsupportedShape(name, f"a member has no elements (shape {tuple(t.shape)}); NVFP4 has no blocks to scale",
                                   f"keep the whole group in BF16 (add it to {key('quantization', 'ignore')})")
    amaxes = [kernels.run_small(_amax_kernel, t.detach()) for t in tensors]
    amax = torch.stack(amaxes).amax(dim=0)
    check_finite_amax(amax, name)
    if rule is ElementRule.ENGINE:
        gs = (F4E2M1_MAX * F8E4M3_MAX) / amax.clamp(min=GLOBAL_AMAX_FLOOR)
    else:
        gs = (F8E4M3_MAX * F4E2M1_MAX) / amax.clamp(min=_FP32_TINY)
        gs = torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0)
    return gs.reshape(*amax.shape, 1) if amax.dim() else gs.reshape(1)


def _amax_kernel(t: torch.Tensor, fast: bool = False) -> torch.Tensor:
    """The largest |x| of each [N, K] matrix of `t`, in float32."""
    return t.abs().amax(dim=(-2, -1)).float()


def _reciprocal(t: torch.Tensor) -> torch.Tensor:
    """ref_nvfp4_quant's get_reciprocal: 1 / t, and 1e-8 where t is zero."""
    return 1.0 / (t + (t == 0) * 1e8)


engine_reciprocal = _reciprocal  # the engine rule's reciprocal, for the per-token activation quantizer


def _quantize_kernel(
    w: torch.Tensor, gscale: torch.Tensor, block: int, rule: ElementRule, fast: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = w.float().reshape(*w.shape[:-1], w.shape[-1] // block, block)
    amax = x.abs().amax(dim=-1, keepdim=True)
    gs = gscale.float().reshape(*gscale.shape[:-1], *([1] * (x.dim() - gscale.dim())), 1)
    if rule is ElementRule.ENGINE:
        scale = to_e4m3(gs * (amax * (1 / F4E2M1_MAX))).float()
        scaled = x * _reciprocal(scale * _reciprocal(gs))
    else:
        scale = to_e4m3(gs * (amax / F4E2M1_MAX)).float()
        scale = torch.where(scale == 0, E4M3_EPS, scale)
        scaled = x / (scale / gs)
    scaled = scaled.clamp(-F4E2M1_MAX, F4E2M1_MAX).reshape(w.shape)
    signed_zero = rule is ElementRule.ENGINE
    if fast:
        packed = fast_elements.pack_fp4(fast_elements.e2m1_codes(scaled, signed_zero=signed_zero))
    else:
        packed = pack_fp4(e2m1_codes(scaled, signed_zero=signed_zero))
    return packed, scale.squeeze(-1).to(torch.float8_e4m3fn), amax


def quantize(
    w: torch.Tensor, name: str, gscale: torch.Tensor, rule: ElementRule = ElementRule.ENGINE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [..., K] along K in NVFP4 blocks with a given global scale.

    Args:
        w: the tensor (any float dtype; computed in float32); K must be a multiple of the block.
        name: the tensor's name, for errors.
        gscale: float32 global scale, broadcastable to w's leading dimensions + [1]
            ([1] for a 2-D weight, [E, 1] for experts, [T, 1] per token).
        rule: the element rule.

    Returns:
        (weight_packed uint8 [..., K/2], weight_scale e4m3 [..., K/16]).
    """
    packed, scale, amax = kernels.run(_quantize_kernel, w, gscale, NVFP4.block_size[1], rule)
    check_finite_amax(amax, name)
    return packed, scale


def dequantize(packed: torch.Tensor, scale: torch.Tensor, gscale: torch.Tensor) -> torch.Tensor:
    """float32 [..., K] = E2M1 elements x (block scale / global scale)."""
    block = NVFP4.block_size[1]
    values = e2m1_values(unpack_fp4(packed))
    x = values.reshape(*values.shape[:-1], values.shape[-1] // block, block)
    gs = gscale.float().reshape(*gscale.shape[:-1], *([1] * (x.dim() - gscale.dim())), 1)
    return (x * (scale.float().unsqueeze(-1) / gs)).reshape(values.shape)
