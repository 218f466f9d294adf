"""E2M1 encoding for the compiled codec path: the same bytes as `elements`, in float arithmetic.

torch.compile's CPU backend vectorizes float arithmetic, comparisons and float-to-uint8
conversion, but its integer arithmetic and bit casts (`view(torch.int32)`), which the reference
`elements.e2m1_codes` is made of, run several times slower than the float work around them. So the
compiled kernels encode E2M1 with float operations only and convert the finished byte once:

- a < 2 rounds on the grid of 0.5 (round(2a)), 2 <= a < 4 on the grid of 1, 4 <= a on the grid
  of 2: code = round(a * f) + offset, half to even (`torch.round`), saturating at 6;
- a sign bit set for -0.0 is told apart from +0.0 by the sign of 1 / x;
- two codes make a byte as low + 16 * high.

E4M3 keeps the float8_e4m3fn cast on both paths: the compiled cast measured faster than its
emulation in float operations (`refit bench codecs` profiles each stage).

The eager reference (`elements`) stays the readable definition; tests/codecs/test_fast_path.py
checks both on every float32 whose low 16 bits are 0, 1, 0x7FFF, 0x8000, 0x8001 or 0xFFFF (every
rounding midpoint of the grid, and its neighbours) and end to end on the adversarial blocks.
"""

from __future__ import annotations

import torch

from domain.quant.formats import F4E2M1_MAX


def _negative(x: torch.Tensor, signed_zero: bool) -> torch.Tensor:
    if not signed_zero:
        return x < 0
    return (x < 0) | ((x == 0) & (1.0 / x < 0))  # 1 / -0.0 = -inf


def e2m1_codes(x: torch.Tensor, *, signed_zero: bool = False) -> torch.Tensor:
    """`elements.e2m1_codes` as float32 codes 0..15 (sign in bit 3), for `pack_fp4`."""
    a = x.abs().clamp(max=F4E2M1_MAX)
    factor = torch.where(a < 2.0, 2.0, torch.where(a < 4.0, 1.0, 0.5))
    offset = torch.where(a < 2.0, 0.0, torch.where(a < 4.0, 2.0, 4.0))
    code = torch.round(a * factor) + offset
    return code + 8.0 * _negative(x, signed_zero).to(a.dtype)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """`elements.pack_fp4` of float codes: element 2i in the low nibble, 2i+1 in the high one."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] + 16.0 * pairs[..., 1]).to(torch.uint8)
