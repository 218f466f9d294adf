"""The quantization_config an engine reads (and config.json carries), for a resolved plan: one per
checkpoint layout (docs/export.md#the-configjson-it-writes).

- compressed-tensors: built with compressed-tensors' own objects
  (adapters.compressed_tensors.quantization_config, imported only for this layout: the package
  takes seconds to import). A user's compressed-tensors config (config_file, hf_overrides) or a
  checkpoint's own reaches the engine as written when the dispatch found every field honoured
  (`Resolution.as_written`), with rollout.quantization.ignore appended to its ignore list; a
  rewritten config keeps its `kv_cache_scheme`.
- ModelOpt NVFP4: domain.quant.modelopt_layout's hf_quant_config.
- Native: SGLang's `quant_method: mxfp8` (block [1, 32], scales named `weight_scale_inv`) and
  DeepSeek-style `quant_method: fp8`; a native checkpoint passed through keeps its own.
- BF16: none.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from adapters.engine_profile import SGLANG_MXFP8
from domain.quant import modelopt_layout, naming
from domain.quant.ct_config import unignored
from domain.quant.dispatch import Resolution
from domain.quant.numerics import numerics_metadata
from domain.quant.support import NATIVE_FP8

# The element and MX scale rules the exporter used, recorded in the quantization_config under a key
# of its own: compressed-tensors, vLLM and SGLang read the keys they know and ignore the rest.
NUMERICS_KEY = "rl_refit_numerics"


def sglang_mxfp8_config(bf16_modules: Iterable[str]) -> dict[str, Any]:
    """SGLang's native MXFP8 config (scales read as `weight_scale_inv`).

    Args:
        bf16_modules: Linear module names that stay BF16 (SGLang matches them by name).

    Returns:
        The `quantization_config` dict.
    """
    return {
        "quant_method": "mxfp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [1, 32],
        "ignored_layers": sorted(bf16_modules),
    }


def deepseek_fp8_config(bf16_modules: Iterable[str]) -> dict[str, Any]:
    """Native DeepSeek-style block FP8 config (scales read as `weight_scale_inv`).

    Args:
        bf16_modules: Linear module names that stay BF16.

    Returns:
        The `quantization_config` dict.
    """
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "ignored_layers": sorted(bf16_modules),
    }


def engine_quantization_config(
    resolution: Resolution, bf16_modules: Iterable[str] | None = None, *, extra_ignore: Iterable[str] = ()
) -> dict[str, Any] | None:
    """The quantization_config the engine is sent (and config.json carries) for a resolution.

    Args:
        resolution: the dispatch's resolution.
        bf16_modules: Linear module names kept BF16 (needed by the native layouts, which match
            names exactly; when None, the ignore entries are listed instead).
        extra_ignore: rollout.quantization.ignore (appended to a config sent as written).

    Returns:
        The dict, or None for a BF16 rollout. Layouts the exporter quantizes carry NUMERICS_KEY:
        the element rule and, per format, the MX scale rule and the reference it follows.
    """
    layout, plan, native = resolution.layout, resolution.plan, resolution.native
    if layout == "bf16":
        return None
    if layout == "native-passthrough" or (native is not None and native.method in ("fp8", "mxfp8")):
        return dict(native.config) if native is not None else None
    if resolution.as_written and native is not None:
        from adapters.compressed_tensors.quantization_config import as_written_config

        return _ignoring(as_written_config(native.config, extra_ignore), bf16_modules)
    kept = list(bf16_modules) if bf16_modules is not None else [*naming.DEFAULT_IGNORE, *plan.ignore]
    if layout == modelopt_layout.LAYOUT:
        # vLLM's ModelOpt config excludes a routed-experts layer by its own name (`...mlp.experts`).
        layers = [layer for m in kept if (layer := naming.experts_layer(m)) is not None]
        return {**modelopt_layout.quantization_config([*kept, *layers]), NUMERICS_KEY: numerics_metadata(plan)}
    if layout == SGLANG_MXFP8:
        config = sglang_mxfp8_config(kept)
    elif layout == NATIVE_FP8:
        config = deepseek_fp8_config(kept)
    else:
        from adapters.compressed_tensors.quantization_config import compressed_tensors_config, to_config_json

        config = _ignoring(to_config_json(compressed_tensors_config(plan)), bf16_modules)
        if native is not None and native.config.get("kv_cache_scheme"):
            config["kv_cache_scheme"] = copy.deepcopy(native.config["kv_cache_scheme"])  # honoured either way
    return {**config, NUMERICS_KEY: numerics_metadata(plan)}


def _ignoring(config: dict[str, Any], bf16_modules: Iterable[str] | None) -> dict[str, Any]:
    """`config` with every module written in BF16 that its groups would still reach (a 4-D
    `o_proj.weight`, a convolution) added to its ignore list by exact name: the config must
    claim a quantized layout only for tensors written with their scales."""
    missing = unignored(config, bf16_modules or ())
    if missing:
        config["ignore"] = [*(config.get("ignore") or []), *missing]
    return config
