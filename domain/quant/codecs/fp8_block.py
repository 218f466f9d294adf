"""FP8 block: E4M3 elements, one float32 scale per 128x128 block (edge blocks allowed).

scale = amax_block / 448 in float32; a zero block gets float32 eps (as compressed-tensors'
`calculate_qparams` does) so that it decodes to zeros without NaN. Elements = e4m3(x / scale).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from domain.quant.codecs import compile as kernels
from domain.quant.codecs.checks import check_finite_amax
from domain.quant.codecs.elements import to_e4m3
from domain.quant.formats import F8E4M3_MAX

FP32_EPS = torch.finfo(torch.float32).eps


def _blocked(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Zero-pad [..., N, K] to whole blocks and view it as [..., N/br, br, K/bc, bc]."""
    br, bc = block
    *lead, n, k = x.shape
    nb, kb = -(-n // br), -(-k // bc)
    if nb * br != n or kb * bc != k:
        x = F.pad(x, (0, kb * bc - k, 0, nb * br - n))
    return x.reshape(*lead, nb, br, kb, bc)


def _quantize_kernel(
    w: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    *_, n, k = w.shape
    xb = _blocked(w.float(), block)
    amax = xb.abs().amax(dim=(-3, -1))
    scale = amax / F8E4M3_MAX
    scale = torch.where(scale == 0, FP32_EPS, scale)
    q = to_e4m3(xb / scale[..., :, None, :, None])
    q = q.reshape(*q.shape[:-4], q.shape[-4] * q.shape[-3], q.shape[-2] * q.shape[-1])
    return q[..., :n, :k].contiguous(), scale, amax


def quantize(
    w: torch.Tensor, name: str, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [..., N, K] to (e4m3 [..., N, K], float32 scale [..., ceil(N/br), ceil(K/bc)]).

    Args:
        w: the weight (any float dtype; computed in float32).
        name: the tensor's name, for errors.
        block: (rows, cols) of one scale block.

    Returns:
        The E4M3 elements and the float32 block scales.
    """
    q, scale, amax = kernels.run(_quantize_kernel, w, block)
    check_finite_amax(amax, name)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """float32 [..., N, K] = e4m3 elements x their block's scale."""
    *_, n, k = q.shape
    xb = _blocked(q.float(), block)
    out = xb * scale[..., :, None, :, None]
    out = out.reshape(*out.shape[:-4], out.shape[-4] * out.shape[-3], out.shape[-2] * out.shape[-1])
    return out[..., :n, :k].contiguous()
