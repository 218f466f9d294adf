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

from adapters.engine_overrides import check_request, with_quantization_config
from adapters.sglang.staging import LOADER_PATH
from domain.quant.backend_policy import DEEP_GEMM, BackendDecision

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
        quantization_config: what the engine is sent
            (adapters.engine_quantization.engine_quantization_config), or None for BF16.
        decision: the backend policy's decision for SGLang.
        kv_cache_dtype: SGLang's `kv_cache_dtype`.
        base: the user's other server arguments, kept; a `json_model_override_args` there is
            merged (its quantization_config replaced), a `custom_weight_loader` list extended.

    Returns:
        The keyword arguments. Raises ConfigError for a decision of another engine or an
        unknown kv_cache_dtype.
    """
    check_request("sglang", "SGLang", decision, kv_cache_dtype, KV_CACHE_DTYPES)
    kwargs = dict(base or {})
    given = kwargs.get("json_model_override_args") or {}
    overrides, quantization = with_quantization_config(
        json.loads(given) if isinstance(given, str) else given, quantization_config
    )
    if quantization is not None:
        kwargs["quantization"] = quantization
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
