"""Reading a `quantization_config` (checkpoint, engine override or user file) into a plan.

Pure dictionary inspection: which method a config names, whether the trainer can export it,
and the QuantizationPlan it amounts to. Recognised: compressed-tensors configs whose groups are
one of the presets, native DeepSeek-style FP8 (`quant_method: fp8`, `weight_block_size:
[128, 128]`) and SGLang's native MXFP8 (`quant_method: mxfp8`). Everything else (GPT-OSS's
native mxfp4, GPTQ, AWQ, per-tensor FP8, ...) is a method the trainer cannot export.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import attrs

from domain.errors import ConfigError
from domain.quant import naming
from domain.quant.formats import FP8_BLOCK, MXFP4, MXFP8, NVFP4, ActivationScheme, PrecisionFormat
from domain.quant.plan import QuantizationPlan

# Probe module names: which of a config group's targets cover dense layers, which experts.
_DENSE_PROBES = ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj")
_EXPERT_PROBES = ("model.layers.0.mlp.experts.0.down_proj", "model.layers.0.mlp.experts")


@attrs.frozen
class NativeConfig:
    """A quantization_config and what rl-refit makes of it.

    Attributes:
        config: the dictionary itself (passed to the engine unchanged when native).
        method: its `quant_method` ("compressed-tensors", "fp8", "mxfp8", "mxfp4", ...).
        plan: the equivalent plan, or None when the trainer cannot export this method.
        problem: why it cannot be exported (None when it can).
    """

    config: Mapping[str, Any]
    method: str
    plan: QuantizationPlan | None
    problem: str | None = None

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


def _args(group: Mapping[str, Any], which: str) -> Mapping[str, Any] | None:
    value = group.get(which)
    return value if isinstance(value, Mapping) else None


def _weight_format(w: Mapping[str, Any] | None) -> PrecisionFormat | None:
    if not w or w.get("type") != "float":
        return None
    bits, strategy, gsize = w.get("num_bits"), w.get("strategy"), w.get("group_size")
    if bits == 8 and strategy == "block" and list(w.get("block_structure") or []) == [128, 128]:
        return FP8_BLOCK
    if bits == 8 and strategy == "group" and gsize == 32:
        return MXFP8
    if bits == 4 and strategy == "group" and gsize == 32:
        return MXFP4
    if bits == 4 and strategy == "tensor_group" and gsize == 16:
        return NVFP4
    return None


def _activation(a: Mapping[str, Any] | None) -> ActivationScheme | None:
    if a is None:
        return ActivationScheme.NONE
    if a.get("type") != "float":
        return None
    bits, strategy, gsize, dyn = a.get("num_bits"), a.get("strategy"), a.get("group_size"), a.get("dynamic")
    if bits == 8 and strategy == "group" and gsize == 128 and dyn is True:
        return ActivationScheme.FP8_GROUP_128
    if bits == 8 and strategy == "group" and gsize == 32 and dyn is True:
        return ActivationScheme.MXFP8
    if bits == 4 and strategy == "group" and gsize == 32 and dyn is True:
        return ActivationScheme.MXFP4
    if bits == 4 and strategy == "tensor_group" and gsize == 16:
        return ActivationScheme.NVFP4_PER_TOKEN if dyn is True else ActivationScheme.NVFP4_STATIC
    return None


def _target_matches(target: str, name: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or name.endswith("." + target)


def _roles(targets: list[str]) -> set[str]:
    if "Linear" in targets:
        return {"linear", "moe"}
    roles = set()
    if any(_target_matches(t, n) for t in targets for n in _DENSE_PROBES):
        roles.add("linear")
    if any(_target_matches(t, n) for t in targets for n in _EXPERT_PROBES):
        roles.add("moe")
    return roles


def _from_compressed_tensors(qc: Mapping[str, Any], ignore: tuple[str, ...]) -> tuple[QuantizationPlan | None, str | None]:
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        return None, "compressed-tensors config without config_groups"
    chosen: dict[str, tuple[PrecisionFormat, ActivationScheme, bool]] = {}
    for gname, group in groups.items():
        if not isinstance(group, Mapping):
            return None, f"config group {gname!r} is not a dict"
        fmt = _weight_format(_args(group, "weights"))
        act = _activation(_args(group, "input_activations"))
        if fmt is None or act is None:
            return None, f"config group {gname!r} is not one of the presets FP8_BLOCK, MXFP8, MXFP4, NVFP4"
        targets = [str(t) for t in group.get("targets") or []]
        specific = "Linear" not in targets
        for role in _roles(targets):
            # a name-matching group beats a class ("Linear") group, as engines resolve targets
            if role not in chosen or (specific and not chosen[role][2]):
                chosen[role] = (fmt, act, specific)
    entries = [str(e) for e in qc.get("ignore") or ()]
    if any(_target_matches(e, n) for e in entries for n in _EXPERT_PROBES):
        chosen.pop("moe", None)  # "Linear" with the experts ignored: a dense-only plan
    if not chosen:
        return None, "no config group targets Linear layers or experts"
    lin, moe = chosen.get("linear"), chosen.get("moe")
    implied = {naming.to_engine_pattern(e) for e in naming.DEFAULT_IGNORE} | {naming.EXPERTS_PATTERN}
    user_ignore = tuple(e for e in entries if e not in implied and e not in naming.DEFAULT_IGNORE)
    plan = QuantizationPlan(
        linear=lin[0] if lin else QuantizationPlan().linear,
        moe=moe[0] if moe else QuantizationPlan().moe,
        linear_activation=lin[1] if lin and lin[1] is not lin[0].activation else None,
        moe_activation=moe[1] if moe and moe[1] is not moe[0].activation else None,
        ignore=user_ignore + ignore,
    )
    return plan, None


def parse_quantization_config(qc: Mapping[str, Any], *, ignore: tuple[str, ...] = ()) -> NativeConfig:
    """Interpret one quantization_config.

    Args:
        qc: the config dict (from config.json, hf_overrides, or a user's config_file).
        ignore: extra ignore entries (the user's rollout.quantization.ignore).

    Returns:
        A NativeConfig: the method, and the plan when the trainer can export it.
    """
    method = str(qc.get("quant_method", "compressed-tensors" if "config_groups" in qc else "unknown"))
    if method == "compressed-tensors":
        plan, problem = _from_compressed_tensors(qc, ignore)
        return NativeConfig(qc, method, plan, problem)
    skipped = tuple(str(e) for e in (qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ()))
    if method == "fp8":
        block = list(qc.get("weight_block_size") or [])
        if block != [128, 128]:
            return NativeConfig(qc, method, None, f"fp8 with weight_block_size {block or None} (only [128, 128] is exported)")
        plan = QuantizationPlan(linear=FP8_BLOCK, moe=FP8_BLOCK, ignore=skipped + ignore, scale_name="weight_scale_inv")
        return NativeConfig(qc, method, plan)
    if method == "mxfp8":
        plan = QuantizationPlan(linear=MXFP8, moe=MXFP8, ignore=skipped + ignore, scale_name="weight_scale_inv")
        return NativeConfig(qc, method, plan)
    return NativeConfig(qc, method, None, f"the trainer has no exporter for quant_method {method!r}")
