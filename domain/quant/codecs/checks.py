"""Input checks shared by the codecs. They raise typed errors naming the tensor."""

from __future__ import annotations

import torch

from domain.errors import BlockMisaligned, NonFiniteTensor, UnsupportedDtype, UnsupportedShape
from domain.keys import key

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_weight(w: torch.Tensor, name: str, *, k_multiple: int, fmt_name: str) -> None:
    """Dtype, rank ([N, K] or per-expert [E, N, K]) and K divisibility of a weight to quantize."""
    if w.dtype not in FLOAT_DTYPES:
        raise UnsupportedDtype(
            name, f"dtype {w.dtype} cannot be quantized", "pass a bfloat16, float16 or float32 tensor"
        )
    if w.dim() not in (2, 3):
        raise UnsupportedShape(
            name,
            f"rank {w.dim()} (shape {tuple(w.shape)}); {fmt_name} quantizes 2-D [N, K] Linear weights "
            "or 3-D [E, N, K] expert weights",
            f"keep this tensor in BF16 (add it to {key('quantization', 'ignore')})",
        )
    if w.numel() == 0:
        raise UnsupportedShape(
            name, f"has no elements (shape {tuple(w.shape)}); {fmt_name} has no blocks to scale",
            f"keep this tensor in BF16 (add it to {key('quantization', 'ignore')})",
        )
    check_last_dim(w, name, k_multiple=k_multiple, fmt_name=fmt_name)


def check_last_dim(x: torch.Tensor, name: str, *, k_multiple: int, fmt_name: str) -> None:
    if k_multiple > 1 and x.shape[-1] % k_multiple:
        raise BlockMisaligned(
            name,
            f"last dimension {x.shape[-1]} is not a multiple of {k_multiple}, the {fmt_name} block",
            f"keep this tensor in BF16 (add it to {key('quantization', 'ignore')})",
        )


def check_finite_amax(amax: torch.Tensor, name: str) -> None:
    """NaN and Inf propagate into the block maxima, so checking them is checking the tensor."""
    if not bool(torch.isfinite(amax).all()):
        raise NonFiniteTensor(
            name,
            "holds NaN or Inf values",
            "fix the trainer step that produced them; nothing was quantized",
        )
