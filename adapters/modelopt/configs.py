"""Rollout plans as ModelOpt quantization configs (`modelopt.torch.quantization`).

ModelOpt's own presets give the weight quantizer attributes of each format:

| preset    | ModelOpt config                      | weight quantizer                                          |
|-----------|--------------------------------------|-----------------------------------------------------------|
| FP8_BLOCK | FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG     | num_bits (4, 3), block_sizes {-1: 128, -2: 128}            |
| MXFP8     | MXFP8_DEFAULT_CFG                    | num_bits (4, 3), block_sizes {-1: 32, dynamic, scale (8, 0)} |
| MXFP4     | MXFP4_DEFAULT_CFG                    | num_bits (2, 1), block_sizes {-1: 32, dynamic, scale (8, 0)} |
| NVFP4     | NVFP4_DEFAULT_CFG                    | num_bits (2, 1), block_sizes {-1: 16, dynamic, scale (4, 3)} |

Activations: ModelOpt's MX input quantizers are dynamic per 1x32 block like the rollout's; its
NVFP4 input quantizer uses one per-tensor global scale (calibrated, or the whole batch's amax) and
it has no dynamic FP8 1x128 quantizer. The rollout quantizes NVFP4 activations per token and FP8
activations per 1x128 group, so those input quantizers run the codec through a registered
ModelOpt quant backend (`backend` / `backend_extra_args` of the quantizer attribute config).

Weights: with `numerics="exporter"` (the default) the weight quantizers run the exporter's
quantize-dequantize through the same registered backend, under the plan's element rule; with
`numerics="modelopt"` they run ModelOpt's own kernels, and the first-forward check compares them
with the exporter bit for bit. ModelOpt's FP8 block kernel (`tensor_quant._fp8_eager`, CPU and
GPU) computes neither element rule: it multiplies by 448 / amax (not by 1 / (amax / 448), vLLM's
and DeepGEMM's order) and decodes with 1 / (448 / amax) (not amax / 448), so on real weights it
differs from the export on a few elements per thousand under either rule (NATIVE_ORDERS).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from domain.quant.formats import FP8_BLOCK, MXFP4, MXFP8, NVFP4, ActivationScheme

# preset -> the ModelOpt config whose `*weight_quantizer` entry describes its weights.
MODELOPT_CONFIGS: dict[str, str] = {
    FP8_BLOCK.name: "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG",
    MXFP8.name: "MXFP8_DEFAULT_CFG",
    MXFP4.name: "MXFP4_DEFAULT_CFG",
    NVFP4.name: "NVFP4_DEFAULT_CFG",
}
# activation scheme -> the ModelOpt config whose `*input_quantizer` matches it (dynamic MX only).
NATIVE_INPUT_CONFIGS: dict[ActivationScheme, str] = {
    ActivationScheme.MXFP8: "MXFP8_DEFAULT_CFG",
    ActivationScheme.MXFP4: "MXFP4_DEFAULT_CFG",
}
NUMERICS = ("exporter", "modelopt")
# What ModelOpt's own weight kernels compute, for the first-forward check's message.
NATIVE_ORDERS: dict[str, str] = {
    FP8_BLOCK.name: "e4m3(x * (448 / amax)) decoded as q * (1 / (448 / amax)) (tensor_quant._fp8_eager)",
}


def _entry(mtq: Any, config_name: str, quantizer: str) -> dict[str, Any]:
    for item in getattr(mtq, config_name)["quant_cfg"]:
        if item.get("quantizer_name") == f"*{quantizer}" and "cfg" in item:
            return copy.deepcopy(dict(item["cfg"]))
    raise KeyError(f"ModelOpt's {config_name} has no '*{quantizer}' entry")


def weight_attributes(mtq: Any, preset: str, *, numerics: str, backend: str, tensor: str) -> dict[str, Any]:
    """The weight quantizer's attribute config for one tensor.

    Args:
        mtq: the `modelopt.torch.quantization` module.
        preset: the tensor's preset name.
        numerics: "exporter" (registered backend) or "modelopt" (ModelOpt's kernels).
        backend: the registered backend's name.
        tensor: the trainer tensor's name (the backend looks it up).

    Returns:
        A QuantizerAttributeConfig dict.
    """
    native = _entry(mtq, MODELOPT_CONFIGS[preset], "weight_quantizer")
    if numerics == "modelopt":
        return native
    return {"num_bits": native["num_bits"], "backend": backend,
            "backend_extra_args": {"tensor": tensor, "role": "weight", "format": preset}}


def input_attributes(mtq: Any, scheme: ActivationScheme, *, numerics: str, backend: str, tensor: str) -> dict[str, Any]:
    """The input quantizer's attribute config for one tensor's layer.

    Args:
        mtq: the `modelopt.torch.quantization` module.
        scheme: the rollout's activation scheme for the layer.
        numerics: "exporter" or "modelopt" (MX inputs then use ModelOpt's dynamic quantizer).
        backend: the registered backend's name.
        tensor: the trainer tensor's name.

    Returns:
        A QuantizerAttributeConfig dict ({"enable": False} for NONE).
    """
    if scheme is ActivationScheme.NONE:
        return {"enable": False}
    if numerics == "modelopt" and scheme in NATIVE_INPUT_CONFIGS:
        return _entry(mtq, NATIVE_INPUT_CONFIGS[scheme], "input_quantizer")
    bits = (2, 1) if scheme in (ActivationScheme.MXFP4, ActivationScheme.NVFP4_PER_TOKEN) else (4, 3)
    return {"num_bits": bits, "backend": backend,
            "backend_extra_args": {"tensor": tensor, "role": "input", "scheme": scheme.value}}


def _block(block_sizes: Mapping[Any, Any] | None, key: int) -> Any:
    if not block_sizes:
        return None
    return block_sizes.get(key, block_sizes.get(str(key)))


def preset_of(num_bits: Any, block_sizes: Mapping[Any, Any] | None) -> str:
    """The preset a native ModelOpt weight quantizer implements, or a description of it.

    Args:
        num_bits: the quantizer's num_bits.
        block_sizes: its block_sizes.

    Returns:
        "FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4", or "modelopt(num_bits=..., block_sizes=...)".
    """
    bits = tuple(num_bits) if isinstance(num_bits, (list, tuple)) else num_bits
    scale = tuple((block_sizes or {}).get("scale_bits") or ()) or None
    last, rows = _block(block_sizes, -1), _block(block_sizes, -2)
    if bits == (4, 3) and last == 128 and rows == 128:
        return FP8_BLOCK.name
    if last == 32 and scale == (8, 0):
        return {(4, 3): MXFP8.name, (2, 1): MXFP4.name}.get(bits, f"modelopt(num_bits={bits}, block_sizes={block_sizes})")
    if bits == (2, 1) and last == 16 and scale == (4, 3):
        return NVFP4.name
    return f"modelopt(num_bits={bits}, block_sizes={dict(block_sizes or {})})"


def scheme_of(num_bits: Any, block_sizes: Mapping[Any, Any] | None) -> str:
    """The activation scheme a native ModelOpt input quantizer implements, or a description."""
    preset = preset_of(num_bits, block_sizes)
    if preset in (MXFP8.name, MXFP4.name):
        return preset.lower()
    if preset == NVFP4.name:
        return "modelopt nvfp4 per-tensor"
    return preset
