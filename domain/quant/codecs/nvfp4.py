"""NVFP4: E2M1 elements, one E4M3 scale per 16 elements along K, times a float32 global scale.

The global scale is an encode multiplier, as compressed-tensors stores it (engines invert it):
global_scale = 448 * 6 / amax_tensor. Block scale = e4m3(global_scale * (amax_block / 6)); a block
scale that rounds to zero is stored as 0.125 (compressed-tensors' eps for e4m3). Elements =
E2M1(x / (block_scale / global_scale)), in that operation order.
"""

from __future__ import annotations

import torch

from domain.errors import UnsupportedShape
from domain.quant.codecs import compile as kernels
from domain.quant.codecs.checks import check_finite_amax
from domain.quant.codecs.elements import e2m1_codes, e2m1_values, pack_fp4, to_e4m3, unpack_fp4
from domain.quant.formats import F4E2M1_MAX, F8E4M3_MAX

NVFP4_BLOCK = 16
E4M3_EPS = 0.125
_FP32_TINY = torch.finfo(torch.float32).tiny


def global_scale(*tensors: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """The float32 global scale shared by `tensors` (a fused group shares one).

    Args:
        tensors: [N, K] weights, or [E, N, K] expert weights (one scale per expert).
        name: for errors.

    Returns:
        float32 [1] for 2-D tensors, [E, 1] for 3-D ones. A zero maximum gives 1.0, never Inf.
    """
    for t in tensors:
        if t.numel() == 0:
            raise UnsupportedShape(name, f"a member has no elements (shape {tuple(t.shape)}); NVFP4 has no blocks to scale",
                                   "keep the whole group in BF16 (add it to rollout.quantization.ignore)")
    amaxes = [t.detach().abs().amax(dim=(-2, -1)).float() for t in tensors]
    amax = torch.stack(amaxes).amax(dim=0)
    check_finite_amax(amax, name)
    gs = (F8E4M3_MAX * F4E2M1_MAX) / amax.clamp(min=_FP32_TINY)
    gs = torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0)
    return gs.reshape(*amax.shape, 1) if amax.dim() else gs.reshape(1)


def _quantize_kernel(
    w: torch.Tensor, gscale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = w.float().reshape(*w.shape[:-1], w.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    amax = x.abs().amax(dim=-1, keepdim=True)
    gs = gscale.float().reshape(*gscale.shape[:-1], *([1] * (x.dim() - gscale.dim())), 1)
    scale = to_e4m3(gs * (amax / F4E2M1_MAX)).float()
    scale = torch.where(scale == 0, E4M3_EPS, scale)
    codes = e2m1_codes((x / (scale / gs)).clamp(-F4E2M1_MAX, F4E2M1_MAX).reshape(w.shape))
    return pack_fp4(codes), scale.squeeze(-1).to(torch.float8_e4m3fn), amax


def quantize(
    w: torch.Tensor, name: str, gscale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [..., K] along K in blocks of 16 with a given global scale.

    Args:
        w: the tensor (any float dtype; computed in float32); K must be a multiple of 16.
        name: the tensor's name, for errors.
        gscale: float32 global scale, broadcastable to w's leading dimensions + [1]
            ([1] for a 2-D weight, [E, 1] for experts, [T, 1] per token).

    Returns:
        (weight_packed uint8 [..., K/2], weight_scale e4m3 [..., K/16]).
    """
    packed, scale, amax = kernels.run(_quantize_kernel, w, gscale)
    check_finite_amax(amax, name)
    return packed, scale


def dequantize(packed: torch.Tensor, scale: torch.Tensor, gscale: torch.Tensor) -> torch.Tensor:
    """float32 [..., K] = E2M1 elements x (block scale / global scale)."""
    values = e2m1_values(unpack_fp4(packed))
    x = values.reshape(*values.shape[:-1], values.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    gs = gscale.float().reshape(*gscale.shape[:-1], *([1] * (x.dim() - gscale.dim())), 1)
    return (x * (scale.float().unsqueeze(-1) / gs)).reshape(values.shape)
