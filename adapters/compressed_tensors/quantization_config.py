"""The compressed-tensors layout's quantization_config, built with compressed-tensors' own objects
(QuantizationConfig, QuantizationScheme, preset QuantizationArgs, CompressionFormat) and serialized
the way its ModelCompressor writes config.json; a user's own config checked by its
QuantizationConfig, and passed on as written.

adapters.engine_quantization chooses the layout and imports this module only for the
compressed-tensors one: importing compressed-tensors takes seconds (it imports transformers).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

try:
    from compressed_tensors.base import (
        QUANTIZATION_METHOD,
        QUANTIZATION_METHOD_NAME,
        SPARSITY_CONFIG_NAME,
        TRANSFORM_CONFIG_NAME,
    )
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    # compressed-tensors' own dependency: its configs are pydantic models
    from pydantic import ValidationError
except ModuleNotFoundError as err:  # pragma: no cover - exercised only without the package
    raise ModuleNotFoundError(
        "adapters.compressed_tensors needs the compressed-tensors package (pip install compressed-tensors)",
        name="compressed_tensors",
    ) from err

from domain.errors import ConfigError
from domain.quant import naming
from domain.quant.formats import ActivationScheme, PrecisionFormat
from domain.quant.plan import QuantizationPlan

EXPERTS_TARGET = naming.EXPERTS_PATTERN

# compressed-tensors preset whose input_activations each activation scheme takes.
_ACTIVATION_PRESET = {
    ActivationScheme.FP8_GROUP_128: "FP8_BLOCK",
    ActivationScheme.MXFP8: "MXFP8",
    ActivationScheme.MXFP4: "MXFP4",
    ActivationScheme.NVFP4_STATIC: "NVFP4",
    ActivationScheme.NVFP4_PER_TOKEN: "NVFP4",
}


def _scheme(fmt: PrecisionFormat, act: ActivationScheme, targets: list[str]) -> QuantizationScheme:
    weights = copy.deepcopy(PRESET_SCHEMES[fmt.name]["weights"])
    inputs = None
    if act is not ActivationScheme.NONE:
        inputs = copy.deepcopy(PRESET_SCHEMES[_ACTIVATION_PRESET[act]]["input_activations"])
        if act is ActivationScheme.NVFP4_PER_TOKEN:
            # every scale computed on the fly, per token: no calibrated input_global_scale
            inputs = inputs.model_copy(update={"dynamic": True, "observer": None})
    return QuantizationScheme(
        targets=targets, weights=weights, input_activations=inputs, format=CompressionFormat(fmt.ct_format).value
    )


def compressed_tensors_config(plan: QuantizationPlan) -> QuantizationConfig:
    """The compressed-tensors QuantizationConfig of a plan (mixed-precision when linear and MoE differ).

    Args:
        plan: a quantized plan.

    Returns:
        The QuantizationConfig object (status "compressed").
    """
    lin = (plan.linear, plan.effective_linear_activation)
    moe = (plan.moe, plan.effective_moe_activation)
    ignore = [naming.to_engine_pattern(e) for e in (*naming.DEFAULT_IGNORE, *plan.ignore)]
    groups: dict[str, QuantizationScheme] = {}
    if plan.linear.is_quantized and plan.moe.is_quantized and lin == moe:
        groups["group_0"] = _scheme(*lin, ["Linear"])
    else:
        if plan.moe.is_quantized:
            groups[f"group_{len(groups)}"] = _scheme(*moe, [EXPERTS_TARGET])
        if plan.linear.is_quantized:
            groups[f"group_{len(groups)}"] = _scheme(*lin, ["Linear"])
            if not plan.moe.is_quantized:
                ignore.append(EXPERTS_TARGET)
    formats = {g.format for g in groups.values()}
    return QuantizationConfig(
        config_groups=groups,
        format=formats.pop() if len(formats) == 1 else CompressionFormat.mixed_precision.value,
        ignore=list(dict.fromkeys(ignore)),
        quantization_status=QuantizationStatus.COMPRESSED,
    )


# QuantizationArgs fields that only calibration reads (how to observe a range): a compressed
# checkpoint has its scales, and each compressed-tensors release fills these with other defaults.
_CALIBRATION_FIELDS = frozenset({"observer", "observer_kwargs"})
# QuantizationConfig fields a release adds with a neutral value (0.17 `run_compressed: true`,
# 0.20 `moe_sparsity_config: null`) and engines load the same without.
_RELEASE_FIELDS = frozenset({"run_compressed", "moe_sparsity_config", "global_compression_ratio"})


def _canonical(value: Any) -> Any:
    """`value` with None members and calibration fields left out, at every depth."""
    if isinstance(value, Mapping):
        return {k: _canonical(v) for k, v in value.items() if v is not None and k not in _CALIBRATION_FIELDS}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def to_config_json(qc: QuantizationConfig) -> dict[str, Any]:
    """Serialize a QuantizationConfig for config.json, the same under every compressed-tensors release.

    The keys are those ModelCompressor.update_config writes, less what differs between releases
    and no loader reads: the `version` stamp, fields left None, calibration observers, and the
    release-specific neutral fields. compressed-tensors 0.17 and 0.20 parse the result back to
    the configuration they were given.

    Args:
        qc: the config.

    Returns:
        The `quantization_config` dict.
    """
    dumped = qc.model_dump(mode="json", exclude={"quant_method", *_RELEASE_FIELDS})
    return {
        QUANTIZATION_METHOD_NAME: QUANTIZATION_METHOD,
        SPARSITY_CONFIG_NAME: {},
        TRANSFORM_CONFIG_NAME: {},
        **_canonical(dumped),
    }


def attach_schemes(model: Any, qc: QuantizationConfig) -> None:
    """compressed-tensors' apply_quantization_config, quiet under every supported release.

    0.20 draws a progress bar unless told `show_progress=False`; 0.17 has no such argument.

    Args:
        model: the torch module to attach the schemes (and their scale parameters) to.
        qc: the config.
    """
    if "show_progress" in inspect.signature(apply_quantization_config).parameters:
        apply_quantization_config(model, qc, show_progress=False)
    else:
        apply_quantization_config(model, qc)


_SHOWN_PROBLEMS = 3


def _field(loc: tuple[Any, ...]) -> str:
    # pydantic tags the branches of unions and validators into the location: keep the fields
    return ".".join(str(p) for p in loc if not any(c in str(p) for c in "[(")) or "<config>"


def _problems(err: ValidationError) -> list[str]:
    """One `field: what is wrong (got VALUE)` per problem; a union's other branch (a config
    group written as a bare list of targets) only when nothing else is wrong."""
    errors = err.errors()
    own = [e for e in errors if "list[str]" not in map(str, e["loc"])] or errors
    out: dict[str, None] = {}
    for e in own:
        got = repr(e.get("input"))
        got = got if len(got) <= 40 else got[:37] + "..."
        what = str(e["msg"]).removeprefix("Value error, ").splitlines()[0]
        out[f"{_field(e['loc'])}: {what} (got {got})"] = None
    return list(out)


def check_user_config(qc: Mapping[str, Any], key: str) -> None:
    """A compressed-tensors quantization_config a user supplies must be one compressed-tensors'
    own QuantizationConfig accepts: it reaches the engine as written, and the engine parses it
    with that class.

    Args:
        qc: the config dict.
        key: the configuration key it came from (named in the error).

    Returns:
        None. Raises ConfigError naming the key and the fields compressed-tensors rejects.
    """
    try:
        QuantizationConfig.model_validate(dict(qc))
    except (ValueError, TypeError) as err:  # pydantic.ValidationError is a ValueError
        problems = _problems(err) if isinstance(err, ValidationError) else [str(err)]
        more = f" (and {len(problems) - _SHOWN_PROBLEMS} more)" if len(problems) > _SHOWN_PROBLEMS else ""
        raise ConfigError(key, f"compressed-tensors rejects this quantization_config: "
                               f"{'; '.join(problems[:_SHOWN_PROBLEMS])}{more}; fix those fields") from None


def as_written_config(config: Mapping[str, Any], extra_ignore: Iterable[str] = ()) -> dict[str, Any]:
    """A compressed-tensors config as the user wrote it, for the engine.

    Args:
        config: the quantization_config (groups, ignore list, kv_cache_scheme, ... untouched).
        extra_ignore: rollout.quantization.ignore entries, appended to its ignore list in the
            syntax engines read.

    Returns:
        A copy; `quant_method` is added when the file leaves it out (engines dispatch on it).
    """
    out = copy.deepcopy(dict(config))
    out.setdefault(QUANTIZATION_METHOD_NAME, QUANTIZATION_METHOD)
    extra = [naming.to_engine_pattern(e) for e in extra_ignore]
    if extra:
        ignore = list(out.get("ignore") or [])
        out["ignore"] = ignore + [e for e in extra if e not in ignore]
    return out
