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


_FIELDS = ("type", "num_bits", "strategy", "block_structure", "group_size", "symmetric", "dynamic")


def _args(args: Any) -> str:
    if not isinstance(args, Mapping):
        return "none"
    return " ".join(f"{k}={args[k]}" for k in _FIELDS if args.get(k) is not None)


def quantization_scheme(config: Any) -> str | None:
    """What a model's `quantization_config` makes of its weights and activations, in one canonical
    line, to tell whether a server serves a plan: the method and format; per compressed-tensors
    config group its targets and the weights' and input activations' type, bits, strategy, block
    or group, symmetry and dynamism; the layers left out (`ignore`); for ModelOpt its algorithm,
    group size and excluded modules. Fields that do not change what is served (observers, status,
    versions) are left out, so a checkpoint written by llm-compressor and the plan's config compare
    equal when they quantize alike. None without a config."""
    if hasattr(config, "to_dict") and not isinstance(config, Mapping):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        return None
    method = str(config.get("quant_method", "compressed-tensors"))
    if method.startswith("modelopt"):
        nested = config.get("quantization")
        quant: Mapping[str, Any] = nested if isinstance(nested, Mapping) else config
        excluded = sorted(str(m) for m in quant.get("exclude_modules") or quant.get("ignore") or ())
        return (f"modelopt {quant.get('quant_algo')} group_size={quant.get('group_size')}"
                f"; exclude {', '.join(excluded) or '-'}")
    found = config.get("config_groups")
    groups: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    parts = [f"{method} {config.get('format')}"]
    for name in sorted(groups):
        group = groups[name] if isinstance(groups[name], Mapping) else {}
        targets = ",".join(sorted(str(t) for t in group.get("targets") or ()))
        parts.append(f"{targets}: weights {_args(group.get('weights'))}; inputs {_args(group.get('input_activations'))}")
    ignore = sorted(str(i) for i in config.get("ignore") or ())
    parts.append(f"ignore {', '.join(ignore) or '-'}")
    return "; ".join(parts)
