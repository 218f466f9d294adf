"""What the vLLM and SGLang engine-argument builders share: the request checks and the
replacement of the model config's `quantization_config` by the plan's. Imports nothing heavy."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from domain.errors import ConfigError
from domain.quant.backend_policy import BackendDecision


def check_request(engine: str, label: str, decision: BackendDecision, kv_cache_dtype: str,
                  valid_kv_dtypes: tuple[str, ...]) -> None:
    """Raise ConfigError for another engine's backend decision or an unknown KV-cache dtype."""
    if decision.engine != engine:
        raise ConfigError("rollout.name", f"a backend decision for {decision.engine!r} cannot configure {label}")
    if kv_cache_dtype not in valid_kv_dtypes:
        raise ConfigError("rollout.kv_cache_dtype", f"{kv_cache_dtype!r} is not one of {', '.join(valid_kv_dtypes)}")


def with_quantization_config(
    overrides: Mapping[str, Any], quantization_config: Mapping[str, Any] | None
) -> tuple[dict[str, Any], str | None]:
    """The user's model-config overrides with their `quantization_config` replaced by the plan's.

    Args:
        overrides: the overrides the user gave (kept otherwise).
        quantization_config: what the engine is sent, or None for BF16.

    Returns:
        (overrides, the engine's `quantization` argument or None for BF16).
    """
    merged = dict(overrides)
    merged.pop("quantization_config", None)
    if quantization_config is None:
        return merged, None
    merged["quantization_config"] = dict(quantization_config)
    return merged, str(quantization_config.get("quant_method", "compressed-tensors"))
