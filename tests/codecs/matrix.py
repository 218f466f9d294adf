"""The weights every reference comparison runs on (the issue's test matrix).

Each case is a named 2-D weight [N, K] or 3-D expert weight [E, N, K]; `cases(fmt)` returns the
ones the format can take (K a multiple of 32 for every case but the FP8 edge blocks):
- real-shaped: Linear-like shapes (a down_proj, a fused gate_up) with an LLM-like distribution
  (normal, std 0.02, a few large outliers), in bf16;
- normals at several scales (1e-6 to 1e3) in bf16, and one in fp16 and fp32;
- special values (tests/codecs/special.py): zero blocks, powers of two, 1.75 x 2^k maxima, values
  beyond the element maximum, subnormals, maxima just below a power of two;
- all-zero, and tiny-amax blocks (below FP8's 1e-4 floor, NVFP4's 1e-8 floor, and subnormal);
- exact ties: blocks whose elements land exactly on the E4M3 / E2M1 rounding midpoints, with
  power-of-two scales so that every rule computes the same tie;
- FP8 edge blocks (N and K not multiples of 128); 3-D experts.
"""

from __future__ import annotations

import torch

from domain.quant.formats import FP8_BLOCK, NVFP4, PrecisionFormat
from tests.codecs.special import special_weight

E4M3_TIES = (42.0, 1.0625, 0.53125, 3 * 2.0**-10, 432.0)  # midpoints of the E4M3 grid (one subnormal)
E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def real_shaped(n: int, k: int, seed: int) -> torch.Tensor:
    """An LLM-like bf16 weight: normal with std 0.02 and about 0.1% outliers 10-30x larger."""
    g = _gen(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    outliers = torch.rand(n, k, generator=g) < 1e-3
    w = torch.where(outliers, w * (10 + 20 * torch.rand(n, k, generator=g)), w)
    return w.to(torch.bfloat16)


def tiny_blocks(n: int, k: int, seed: int) -> torch.Tensor:
    """Rows of 32-element blocks whose maxima sit at or below the engines' amax floors."""
    g = _gen(seed)
    w = torch.randn(n, k, generator=g)
    amax = torch.tensor([1e-9, 5e-8, 1e-6, 5e-5, 2.0**-130, 0.0, 1.0, 2.0**-120])
    per_block = amax.repeat(n * k // 32 // len(amax) + 1)[: n * k // 32].reshape(n, k // 32, 1)
    blocks = w.reshape(n, k // 32, 32)
    blocks = blocks / blocks.abs().amax(-1, keepdim=True) * per_block
    return blocks.reshape(n, k).to(torch.float32)


def exact_ties(fmt: PrecisionFormat, n: int, k: int, seed: int) -> torch.Tensor:
    """Blocks whose scaled values are exactly the format's rounding midpoints, with random signs.

    Each block holds the element maximum times a power of two (so its scale is a power of two
    under every rule) and midpoints times that power. NVFP4's tensor maximum is 2688, which makes
    the global scale exactly 1 and each block scale e4m3(6 * 2^j / 6) = 2^j.
    """
    g = _gen(seed)
    top, ties = (6.0, E2M1_TIES) if fmt.element.bits == 4 else (448.0, E4M3_TIES)
    br, bc = fmt.block_size
    values = torch.tensor(ties)[torch.randint(0, len(ties), (n, k), generator=g)]
    values[::br, ::bc] = top
    low, high = (-6, 6) if fmt is NVFP4 else (-20, 20)
    exponent = torch.randint(low, high, (-(-n // br), -(-k // bc)), generator=g).float()
    values = values * torch.exp2(exponent).repeat_interleave(br, 0)[:n].repeat_interleave(bc, 1)[:, :k]
    signs = torch.where(torch.rand(n, k, generator=g) < 0.5, -1.0, 1.0)
    signs[::br, ::bc] = 1.0
    values = values * signs
    if fmt is NVFP4:
        values[0, 0] = 2688.0
    return values.to(torch.bfloat16)


def cases(fmt: PrecisionFormat) -> dict[str, torch.Tensor]:
    """name -> weight, for the format (see the module docstring)."""
    out: dict[str, torch.Tensor] = {
        "real down_proj 256x512": real_shaped(256, 512, 1),
        "real gate_up 768x256": real_shaped(768, 256, 2),
        "normal 1e-6": (torch.randn(128, 256, generator=_gen(3)) * 1e-6).to(torch.bfloat16),
        "normal 1e-3": (torch.randn(128, 256, generator=_gen(4)) * 1e-3).to(torch.bfloat16),
        "normal 1": torch.randn(128, 256, generator=_gen(5)).to(torch.bfloat16),
        "normal 1e3": (torch.randn(128, 256, generator=_gen(6)) * 1e3).to(torch.bfloat16),
        "normal fp16": torch.randn(64, 256, generator=_gen(7)).to(torch.float16),
        "normal fp32": torch.randn(64, 256, generator=_gen(8)),
        "special bf16": special_weight(96, 256, torch.bfloat16, block=16, seed=9),
        "special fp32": special_weight(64, 256, torch.float32, block=32, seed=10),
        "all zero": torch.zeros(64, 128, dtype=torch.bfloat16),
        "tiny blocks": tiny_blocks(64, 256, 11),
        "exact ties": exact_ties(fmt, 128, 256, 12),
        "experts 4x64x128": (torch.randn(4, 64, 128, generator=_gen(13))
                             * torch.tensor([0.01, 0.1, 1.0, 10.0]).view(4, 1, 1)).to(torch.bfloat16),
    }
    if fmt is FP8_BLOCK:
        out["edge blocks 200x300"] = real_shaped(200, 300, 14)
        out["edge blocks 129x257"] = special_weight(129, 257, torch.bfloat16, block=257, seed=15)
    return out


def fused_group(seed: int = 16) -> dict[str, torch.Tensor]:
    """q/k/v of one layer, at different scales: an NVFP4 group shares one global scale."""
    return {"q_proj": real_shaped(256, 256, seed), "k_proj": real_shaped(128, 256, seed + 1) * 4,
            "v_proj": real_shaped(128, 256, seed + 2) * 0.25}
