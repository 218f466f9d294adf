"""Element encodings: E4M3 rounding, E2M1 codes and FP4 nibble packing.

Both roundings are round-to-nearest-even with saturation to the element maximum.
"""

from __future__ import annotations

import torch

from domain.formats import E2M1_VALUES, F8E4M3_MAX

_E2M1_TABLE = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to float8_e4m3fn, saturating at +-448 (the cast alone would give NaN)."""
    return x.clamp(-F8E4M3_MAX, F8E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Encode float32 values as 4-bit E2M1 codes (uint8, one per element).

    The magnitude grid has spacing 0.5 below 2, 1 in [2, 4) and 2 from 4 up, so rounding is
    `round(a / step)` on the right step (torch.round is round-half-to-even), then a saturating
    clamp at code 7 (= 6.0). Bit 3 is the sign of a strictly negative input, so a negative value
    that rounds to zero keeps its sign, as compressed-tensors' packer does.
    """
    a = x.abs()
    code = torch.where(
        a < 2.0,
        torch.round(a * 2.0),
        torch.where(a < 4.0, torch.round(a) + 2.0, torch.round(a * 0.5) + 4.0),
    ).clamp_(max=7.0)
    return code.to(torch.uint8) | ((x < 0).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """Decode 4-bit E2M1 codes (uint8, one per element) to float32."""
    return _E2M1_TABLE.to(codes.device)[codes.long()]


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to the nearest E2M1 value (as float32), saturating at +-6."""
    return e2m1_values(e2m1_codes(x))


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes along the last dimension: element 2i low nibble, 2i+1 high nibble."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_fp4`: uint8 [..., K/2] -> E2M1 codes uint8 [..., K]."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)

