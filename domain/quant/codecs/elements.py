"""Element encodings: E4M3 rounding, E2M1 codes and FP4 nibble packing.

Both roundings are round-to-nearest-even with saturation to the element maximum.
"""

from __future__ import annotations

import torch

from domain.quant.formats import E2M1_VALUES, F8E4M3_MAX

_E2M1_TABLE = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to float8_e4m3fn, saturating at +-448 (the cast alone would give NaN)."""
    return x.clamp(-F8E4M3_MAX, F8E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_codes(x: torch.Tensor, *, signed_zero: bool = False) -> torch.Tensor:
    """Encode float32 values as 4-bit E2M1 codes (uint8, one per element).

    From 1 up, E2M1 is a float with one mantissa bit: rounding the float32 bit pattern to one
    mantissa bit, ties to even (add 0x1FFFFF plus the kept bit, then shift), gives
    2 * biased_exponent + mantissa_bit, and subtracting 252 turns 1.0 into code 2. Below 1 the grid
    is {0, 0.5, 1}: round(2a), half to even. Codes above 7 saturate at 7 (6.0).

    Args:
        x: float32 values, already divided by their scale.
        signed_zero: the sign bit (bit 3) is the float's own sign bit, so -0.0 becomes code 8, as
            the hardware conversion (cvt.rn.satfinite.e2m1x2.f32) and vLLM's Triton MXFP4 kernel
            encode it; when False it marks strictly negative inputs only, as compressed-tensors'
            packer does. Either way a negative value that rounds to zero keeps its sign.

    Returns:
        uint8 codes of x's shape.
    """
    a = x.abs().clamp(max=8.0)
    bits = a.view(torch.int32)
    from_one = ((bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22) - 252
    code = torch.where(a < 1.0, torch.round(a * 2.0).to(torch.int32), from_one).clamp(max=7)
    negative = x.view(torch.int32) < 0 if signed_zero else x < 0  # the int view reads the sign bit
    return code.to(torch.uint8) | (negative.to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """Decode 4-bit E2M1 codes (uint8, one per element) to float32."""
    return _E2M1_TABLE.to(codes.device)[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes along the last dimension: element 2i low nibble, 2i+1 high nibble."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_fp4`: uint8 [..., K/2] -> E2M1 codes uint8 [..., K]."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)

