"""SGLang server arguments for a resolved plan and backend decision.

The quantization_config travels in `json_model_override_args` (SGLang's hf-config override),
`quantization` names its method (`compressed-tensors`, or `mxfp8` for SGLang's native MXFP8),
the refit loader is registered in `custom_weight_loader`, and the backend decision pins
`moe_runner_backend` / `fp8_gemm_runner_backend`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from adapters.sglang.staging import LOADER_PATH
from domain.backend_policy import DEEP_GEMM, BackendDecision
from domain.errors import ConfigError

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")


def sglang_engine_kwargs(
    quantization_config: Mapping[str, Any] | None,
    decision: BackendDecision,
    *,
    kv_cache_dtype: str = "auto",
    base: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for `sglang.Engine(...)` / `ServerArgs(...)`.

    Args:
        quantization_config: what the engine is sent (adapters.compressed_tensors
            engine_quantization_config), or None for BF16.
        decision: the backend policy's decision for SGLang.
        kv_cache_dtype: SGLang's `kv_cache_dtype`.
        base: the user's other server arguments, kept; a `json_model_override_args` there is
            merged (its quantization_config replaced), a `custom_weight_loader` list extended.

    Returns:
        The keyword arguments. Raises ConfigError for a decision of another engine or an
        unknown kv_cache_dtype.
    """
    if decision.engine != "sglang":
        raise ConfigError("rollout.name", f"a backend decision for {decision.engine!r} cannot configure SGLang")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError("rollout.kv_cache_dtype", f"{kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    kwargs = dict(base or {})
    overrides = kwargs.get("json_model_override_args") or {}
    overrides = dict(json.loads(overrides) if isinstance(overrides, str) else overrides)
    overrides.pop("quantization_config", None)
    if quantization_config is not None:
        overrides["quantization_config"] = dict(quantization_config)
        kwargs["quantization"] = str(quantization_config.get("quant_method", "compressed-tensors"))
    if overrides:
        kwargs["json_model_override_args"] = json.dumps(overrides)
    else:
        kwargs.pop("json_model_override_args", None)
    loaders = list(kwargs.get("custom_weight_loader") or [])
    kwargs["custom_weight_loader"] = loaders if LOADER_PATH in loaders else [*loaders, LOADER_PATH]
    kwargs["moe_runner_backend"] = decision.moe.backend
    kwargs["fp8_gemm_runner_backend"] = DEEP_GEMM if decision.linear.backend == DEEP_GEMM else "auto"
    kwargs["kv_cache_dtype"] = kv_cache_dtype
    return kwargs
