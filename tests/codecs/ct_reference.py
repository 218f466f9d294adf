"""compressed-tensors' own quantization path, as llm-compressor runs it: observer-style min/max per
block, `calculate_qparams` (and `generate_gparam` for NVFP4's global scale), then the format's
compressor. Importing this module needs compressed-tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.mxfp8.base import MXFP8QuantizationCompressor
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

from domain.quant.formats import FP8_BLOCK, MXFP4, MXFP8, NVFP4, PrecisionFormat

COMPRESSORS = {MXFP8.name: MXFP8QuantizationCompressor, MXFP4.name: MXFP4PackedCompressor,
               FP8_BLOCK.name: FloatQuantizationCompressor, NVFP4.name: NVFP4PackedCompressor}


def scheme(name: str) -> QuantizationScheme:
    return preset_name_to_scheme(name, ["Linear"])


def group_minmax(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = w.float().reshape(w.shape[0], -1, group)
    return g.amin(-1), g.amax(-1)


def global_scale(*tensors: torch.Tensor) -> torch.Tensor:
    """generate_gparam over the concatenation of `tensors` (a fused group's shared scale)."""
    fused = torch.cat([t.float().reshape(-1) for t in tensors])
    return generate_gparam(fused.amin().reshape(1), fused.amax().reshape(1))


def quantize(fmt: PrecisionFormat, w: torch.Tensor, gs: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """One 2-D weight through compressed-tensors; the compressor's tensors (weight_scale float32 for
    FP8 block, e4m3 for NVFP4, uint8 exponents for MX)."""
    s = scheme(fmt.name)
    if fmt is NVFP4:
        gs = global_scale(w) if gs is None else gs
        scale, _ = calculate_qparams(*group_minmax(w, 16), s.weights, global_scale=gs)
        return NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs}, s)
    if fmt is FP8_BLOCK:
        n, k = w.shape
        padded = F.pad(w.float(), (0, -k % 128, 0, -n % 128))
        blocks = padded.reshape(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128)
        scale, _ = calculate_qparams(blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3)), s.weights)
        return FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, s)
    scale, _ = calculate_qparams(*group_minmax(w, 32), s.weights)
    return COMPRESSORS[fmt.name].compress({"weight": w, "weight_scale": scale}, s)


def decompress(fmt: PrecisionFormat, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return COMPRESSORS[fmt.name].decompress(dict(tensors), scheme(fmt.name))["weight"]
