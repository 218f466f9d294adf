"""Reading a `quantization_config` (checkpoint, engine override or user file) into a plan.

Pure dictionary inspection: which method a config names, whether the trainer can export it,
and the QuantizationPlan it amounts to. Recognised: compressed-tensors configs whose groups are
one of the presets (read as written, by domain.quant.ct_config), native DeepSeek-style FP8
(`quant_method: fp8`, `weight_block_size: [128, 128]`) and SGLang's native MXFP8
(`quant_method: mxfp8`). Everything else (GPT-OSS's
native mxfp4, GPTQ, AWQ, per-tensor FP8, ...) is a method the trainer cannot export.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from domain.errors import ConfigError
from domain.quant import naming
from domain.quant.ct_config import read_compressed_tensors
from domain.quant.formats import FP8_BLOCK, MXFP8
from domain.quant.plan import QuantizationPlan


def _to_strs(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.frozen
class NativeConfig:
    """A quantization_config and what rl-refit makes of it.

    Attributes:
        config: the dictionary itself (passed to the engine unchanged when native).
        method: its `quant_method` ("compressed-tensors", "fp8", "mxfp8", "mxfp4", ...).
        plan: the equivalent plan, or None when the trainer cannot export this method.
        problem: why it cannot be exported (None when it can).
        differences: for a compressed-tensors config, the fields the export cannot honour as
            written (domain.quant.ct_config); the config then reaches the engine only rewritten.
    """

    config: Mapping[str, Any]
    method: str
    plan: QuantizationPlan | None
    problem: str | None = None
    differences: tuple[str, ...] = attrs.field(default=(), converter=_to_strs)

    @property
    def is_compressed_tensors(self) -> bool:
        return self.method == "compressed-tensors"

    @property
    def exportable(self) -> bool:
        return self.plan is not None


def find_quantization_config(model_config: Mapping[str, Any] | None) -> tuple[str, Mapping[str, Any]] | None:
    """The checkpoint's quantization_config, at top level or under `text_config`.

    Args:
        model_config: the parsed config.json, or None.

    Returns:
        (where, config) with where = "quantization_config" or "text_config.quantization_config",
        or None when the checkpoint is not quantized.
    """
    if not model_config:
        return None
    if isinstance(model_config.get("quantization_config"), Mapping):
        return "quantization_config", model_config["quantization_config"]
    text = model_config.get("text_config")
    if isinstance(text, Mapping) and isinstance(text.get("quantization_config"), Mapping):
        return "text_config.quantization_config", text["quantization_config"]
    return None


# Returned by override_quantization_config when hf_overrides sets no quantization_config.
OVERRIDE_ABSENT = object()


def override_quantization_config(hf_overrides: Mapping[str, Any] | str | None, key: str) -> object:
    """The `quantization_config` an engine's hf_overrides sets, if any.

    Args:
        hf_overrides: a dict, a JSON string, or None.
        key: the configuration key (for errors), e.g. `rollout.engine_kwargs.vllm.hf_overrides`.

    Returns:
        The override's dict; None for an explicit null (BF16); OVERRIDE_ABSENT when not set.
    """
    if hf_overrides is None or hf_overrides == "":
        return OVERRIDE_ABSENT
    if isinstance(hf_overrides, str):
        try:
            hf_overrides = json.loads(hf_overrides)
        except json.JSONDecodeError as err:
            raise ConfigError(key, f"not valid JSON ({err.msg} at char {err.pos}); write a dict or a JSON object") from None
    if not isinstance(hf_overrides, Mapping):
        raise ConfigError(key, f"must be a dict or a JSON object, got {type(hf_overrides).__name__}")
    for container in (hf_overrides, hf_overrides.get("text_config")):
        if isinstance(container, Mapping) and "quantization_config" in container:
            value = container["quantization_config"]
            if value is not None and not isinstance(value, Mapping):
                raise ConfigError(f"{key}.quantization_config", "must be a dict or null")
            return value
    return OVERRIDE_ABSENT


def quant_method(qc: Mapping[str, Any]) -> str:
    """A config's `quant_method`; one that names none is compressed-tensors when it has config groups."""
    return str(qc.get("quant_method", "compressed-tensors" if "config_groups" in qc else "unknown"))


def is_compressed_tensors(qc: Mapping[str, Any]) -> bool:
    """Whether a quantization_config is a compressed-tensors one (compressed-tensors parses it)."""
    return quant_method(qc) == "compressed-tensors"


def _pattern_fields(qc: Mapping[str, Any]) -> Iterable[tuple[str, object]]:
    """(field, value) of every list of module names or patterns in a quantization_config."""
    for field in ("ignore", "ignored_layers", "modules_to_not_convert"):
        yield field, qc.get(field)
    groups = qc.get("config_groups")
    if isinstance(groups, Mapping):
        for name, group in groups.items():
            if isinstance(group, Mapping):
                yield f"config_groups.{name}.targets", group.get("targets")


def check_patterns(qc: Mapping[str, Any], key: str) -> None:
    """Every `re:` entry of a config's ignore lists and targets must be a regular expression whose
    matching work is bounded (domain.quant.patterns): rl-refit and the engine match it against
    every module name.

    Args:
        qc: the quantization_config.
        key: where it came from, for the error (e.g. `rollout.quantization.config_file`).

    Returns:
        None. Raises ConfigError naming the key, the field and the entry.
    """
    for field, value in _pattern_fields(qc):
        for i, entry in enumerate(naming.name_list(value) or ()):
            problem = naming.validate_ignore_entry(entry) if entry.startswith("re:") else None
            if problem:
                raise ConfigError(key, f"{field}[{i}]: {problem}")


def parse_quantization_config(qc: Mapping[str, Any], *, ignore: tuple[str, ...] = (),
                              key: str = "quantization_config") -> NativeConfig:
    """Interpret one quantization_config.

    Args:
        qc: the config dict (from config.json, hf_overrides, or a user's config_file).
        ignore: extra ignore entries (the user's rollout.quantization.ignore).
        key: where the config came from, named by its errors.

    Returns:
        A NativeConfig: the method, and the plan when the trainer can export it. Raises
        ConfigError for a `re:` entry that is invalid or whose matching work is unbounded.
    """
    check_patterns(qc, key)
    method = quant_method(qc)
    if method == "compressed-tensors":
        reading = read_compressed_tensors(qc, ignore)
        return NativeConfig(qc, method, reading.plan, reading.problem, reading.differences)
    field = "ignored_layers" if qc.get("ignored_layers") else "modules_to_not_convert"
    skipped = naming.name_list(qc.get(field))
    if skipped is None:
        return NativeConfig(qc, method, None, f"{method} config's {field} is not a list of module names")
    if method == "fp8":
        block = qc.get("weight_block_size") or []
        block = list(block) if isinstance(block, list | tuple) else block
        if block != [128, 128]:
            return NativeConfig(qc, method, None, f"fp8 with weight_block_size {block or None} (only [128, 128] is exported)")
        plan = QuantizationPlan(linear=FP8_BLOCK, moe=FP8_BLOCK, ignore=skipped + ignore, scale_name="weight_scale_inv")
        return NativeConfig(qc, method, plan)
    if method == "mxfp8":
        plan = QuantizationPlan(linear=MXFP8, moe=MXFP8, ignore=skipped + ignore, scale_name="weight_scale_inv")
        return NativeConfig(qc, method, plan)
    return NativeConfig(qc, method, None, f"the trainer has no exporter for quant_method {method!r}")
