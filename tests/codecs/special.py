"""Test tensors with the values that break codecs: zeros, powers of two, 1.75 * 2^k maxima,
values at and beyond the element maximum, subnormals, and plain Gaussian blocks."""

from __future__ import annotations

import torch


def special_weight(n: int, k: int, dtype: torch.dtype, *, block: int = 32, seed: int = 0) -> torch.Tensor:
    """[n, k] in `dtype`; each run of `block` columns of each row gets one pattern, cycling."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g, dtype=torch.float32)
    tiny = torch.finfo(dtype).tiny  # smallest normal of the dtype
    nblocks = k // block
    for r in range(n):
        for b in range(nblocks):
            sl = slice(b * block, (b + 1) * block)
            kind = (r * nblocks + b) % 8
            scale = 2.0 ** int(torch.randint(-12, 12, (1,), generator=g))
            if kind == 0:
                x[r, sl] = 0.0
            elif kind == 1:  # exact powers of two with signs
                e = torch.randint(-6, 6, (block,), generator=g).float()
                s = torch.where(torch.rand(block, generator=g) < 0.5, -1.0, 1.0)
                x[r, sl] = s * torch.exp2(e) * scale
            elif kind == 2:  # amax exactly 1.75 * 2^k (the "even" rule's round-up point)
                x[r, sl] = x[r, sl].clamp(-1.5, 1.5) * scale
                x[r, b * block] = 1.75 * scale
            elif kind == 3:  # values at the E4M3 / E2M1 maxima and beyond
                x[r, sl] = x[r, sl] * 100.0
                x[r, b * block] = 448.0
                x[r, b * block + 1] = -6.0 * 64
                x[r, b * block + 2] = 500.0
            elif kind == 4:  # subnormals of the dtype
                x[r, sl] = torch.rand(block, generator=g) * tiny * 0.9
            elif kind == 5:  # a block whose maximum is just below a power of two
                x[r, sl] = x[r, sl].clamp(-1, 1) * scale
                x[r, b * block + 3] = 2.0 * scale * (1 - 2.0**-7)
            else:
                x[r, sl] = x[r, sl] * scale
    big = torch.finfo(dtype).max
    return x.clamp(-big, big).to(dtype)


def signed_zeros_and_decades(n: int, k: int, *, seed: int = 0) -> torch.Tensor:
    """[n, k] float32: blocks of 32 that alternate between signed zeros (-0.0 and +0.0 beside tiny
    negatives that round to zero) and values spread over 5 decades (1e-3 to 1e2) within one block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g)
    decades = 10.0 ** torch.randint(-3, 2, (n, k), generator=g).float()
    blocks = x.reshape(n, k // 32, 32)
    zeros = torch.where(torch.rand(n, k // 32, 32, generator=g) < 0.5, -0.0, 0.0)
    zeros[..., :4] = -1e-30  # negative, below every element's smallest step
    zeros[..., 4] = 1e-3  # a non-zero maximum, so the block's scale is finite and small
    out = torch.where(torch.arange(k // 32).view(1, -1, 1) % 2 == 0, zeros, (x * decades).reshape(blocks.shape))
    return out.reshape(n, k)
