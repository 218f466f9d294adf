"""Bit-exact codecs for the rollout precision formats (pure torch, vectorized, CPU and GPU).

Public API:
    quantize_weight / dequantize_weight / fake_quantize_weight: a Linear or expert weight to and
        from its compressed-tensors checkpoint tensors.
    nvfp4_global_scale: the global scale a fused NVFP4 group shares.
    fake_quantize_activation: the rollout's dynamic activation quantization, quantize-dequantize.

The registry `CODECS` maps each quantized preset's name to its codec; it is a plain dict built here.
"""

from domain.quant.codecs.activations import fake_quantize_activation
from domain.quant.codecs.api import (
    CODECS,
    QuantizedWeight,
    WeightCodec,
    dequantize_weight,
    fake_quantize_weight,
    nvfp4_global_scale,
    quantize_weight,
)

__all__ = [
    "CODECS",
    "QuantizedWeight",
    "WeightCodec",
    "dequantize_weight",
    "fake_quantize_activation",
    "fake_quantize_weight",
    "nvfp4_global_scale",
    "quantize_weight",
]
