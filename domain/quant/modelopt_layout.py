"""ModelOpt's NVFP4 checkpoint layout for routed experts (docs/formats.md, "ModelOpt NVFP4 experts").

vLLM serves NVFP4 experts with per-token NVFP4 activations only for ModelOpt NVFP4 checkpoints
(`quant_method: modelopt`, `quant_algo: NVFP4`), started with the expert activation override
`quantization_config={"moe": {"activation": "nvfp4_per_token"}}`. Per expert projection the
layout holds what vLLM's own online NVFP4 expert quantizer produces
(`online/nvfp4.py:_quantize_moe_weight_to_nvfp4`):

| tensor | dtype, shape | value |
|---|---|---|
| `weight` | uint8 [N, K/2] | the packed E2M1 elements (compressed-tensors' `weight_packed`) |
| `weight_scale` | e4m3 [N, K/16] | the block scales |
| `weight_scale_2` | float32 [] | the decode scale `1.0 / global_scale` (compressed-tensors stores the encode `global_scale`) |

Gate and up of one expert share one global scale, as vLLM's quantizer computes it over the fused
w13. The trainer's NVFP4 codec already equals vLLM's quantizer bit for bit (elements, block scales,
global scales; tests/vllm/test_engine_quantizers.py); this module renames and inverts. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

LAYOUT = "modelopt-nvfp4"  # domain.quant.support.MODELOPT_NVFP4
QUANT_METHOD = "modelopt"
QUANT_ALGO = "NVFP4"
GROUP_SIZE = 16
# vLLM's expert activation override (engine argument `quantization_config`).
PER_TOKEN_OVERRIDE: Mapping[str, Any] = {"moe": {"activation": "nvfp4_per_token"}}
# compressed-tensors local name -> ModelOpt local name
LOCAL_NAMES: Mapping[str, str] = {
    "weight_packed": "weight",
    "weight_scale": "weight_scale",
    "weight_global_scale": "weight_scale_2",
}


def modelopt_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One NVFP4 projection's checkpoint tensors, from compressed-tensors' names to ModelOpt's.

    Args:
        tensors: local names `weight_packed`, `weight_scale`, `weight_global_scale` (the encode
            multiplier, float32 [1]).

    Returns:
        `weight`, `weight_scale` (the same tensors) and `weight_scale_2`, float32 [], computed as
        vLLM computes it: `(1.0 / global_scale).to(torch.float32)`.
    """
    missing = [n for n in LOCAL_NAMES if n not in tensors]
    if missing:
        raise KeyError(f"an NVFP4 projection needs {', '.join(LOCAL_NAMES)}; missing {', '.join(missing)}")
    global_scale = tensors["weight_global_scale"].reshape(())
    return {
        "weight": tensors["weight_packed"],
        "weight_scale": tensors["weight_scale"],
        "weight_scale_2": (1.0 / global_scale).to(torch.float32),
    }


def rename(name: str) -> str:
    """A full compressed-tensors checkpoint name (`...experts.0.gate_proj.weight_packed`) in ModelOpt's
    naming (`...experts.0.gate_proj.weight`); names of other tensors are returned unchanged."""
    module, _, local = name.rpartition(".")
    return f"{module}.{LOCAL_NAMES[local]}" if module and local in LOCAL_NAMES else name


# Fused modules vLLM builds from several checkpoint modules, by the members' local names. vLLM's
# exclusion matches a fused module only through the model's `packed_modules_mapping`, which some
# models leave without gate_up_proj (Qwen3-MoE), so the fused name is listed too.
FUSED: Mapping[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def with_fused_names(modules: Iterable[str]) -> list[str]:
    """`modules`, plus the fused module (`...qkv_proj`, `...gate_up_proj`) of every group whose
    members are all there."""
    names = list(dict.fromkeys(modules))
    present = set(names)
    for m in list(names):
        prefix, _, local = m.rpartition(".")
        for fused, members in FUSED.items():
            if local == members[0] and all(f"{prefix}.{x}" in present for x in members):
                names.append(f"{prefix}.{fused}")
    return names


def quantization_config(exclude_modules: Iterable[str]) -> dict[str, Any]:
    """config.json's `quantization_config` for NVFP4 experts in ModelOpt's layout.

    Args:
        exclude_modules: every module kept in BF16 (dense Linear layers, `lm_head`, the routers, and
            the experts layer `model.layers.N.mlp.experts` of a layer whose experts stay BF16).
            vLLM matches them exactly, as substrings and as fnmatch patterns; fused modules whose
            members are all listed are added (`with_fused_names`).

    Returns:
        The dict vLLM's ModelOptNvFp4Config reads (its config.json form: `quant_algo`, `ignore`).
    """
    return {"quant_method": QUANT_METHOD, "quant_algo": QUANT_ALGO, "group_size": GROUP_SIZE,
            "ignore": sorted(set(with_fused_names(exclude_modules))), "kv_cache_scheme": None}
