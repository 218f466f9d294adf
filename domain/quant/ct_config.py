"""A compressed-tensors quantization_config read as written: its plan, and what cannot be honoured.

A user's config (rollout.quantization.config_file, an engine's hf_overrides, a checkpoint's
config.json) goes to the engine as written, so the trainer must export exactly what it says:
every config group's targets, the ignore list with compressed-tensors' matching (a `re:`
pattern or an exact name), the `kv_cache_scheme`. `read_compressed_tensors` returns the plan
that does so, and, field by field, whatever the trainer's export cannot honour (a group that is
not a preset, asymmetric weights, sparsity, transforms, a compression format that is not the
preset's, dense layers in two formats). Pure dictionary inspection.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from domain.quant import naming
from domain.quant.formats import FP8_BLOCK, MXFP4, MXFP8, NVFP4, ActivationScheme, PrecisionFormat
from domain.quant.plan import QuantizationPlan, TargetGroup, target_group

# Probe module names: which roles (dense layers, routed experts) a group's targets cover, when
# no model is at hand. Several layers and the vision-language prefix, so that a group limited to
# some layers still shows its role; with a model, dispatch checks every tensor.
_PREFIXES = ("model.layers.", "model.language_model.layers.")
_DENSE_LOCALS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj", "linear_attn.out_proj",
                 "mlp.shared_expert.down_proj")
_EXPERT_LOCALS = ("mlp.experts.0.down_proj", "mlp.experts")
_PROBE_LAYERS = 128
DENSE_PROBES = tuple(f"{p}{i}.{m}" for p in _PREFIXES for i in range(_PROBE_LAYERS) for m in _DENSE_LOCALS)
EXPERT_PROBES = tuple(f"{p}{i}.{m}" for p in _PREFIXES for i in range(_PROBE_LAYERS) for m in _EXPERT_LOCALS)
STANDARD_TARGETS = ("Linear", naming.EXPERTS_PATTERN)
PRESETS = "FP8_BLOCK, MXFP8, MXFP4, NVFP4"


@attrs.frozen
class CtReading:
    """What a compressed-tensors config amounts to.

    Attributes:
        plan: the plan exporting what the config says, or None when no group is a preset.
        problem: why nothing can be exported (None when something can).
        differences: fields the export cannot honour as written, one sentence each.
    """

    plan: QuantizationPlan | None
    problem: str | None = None
    differences: tuple[str, ...] = ()


def _args(group: Mapping[str, Any], which: str) -> Mapping[str, Any] | None:
    value = group.get(which)
    return value if isinstance(value, Mapping) else None


def weight_format(w: Mapping[str, Any] | None) -> PrecisionFormat | None:
    """The preset a group's `weights` arguments describe, or None."""
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


def activation_scheme(a: Mapping[str, Any] | None) -> ActivationScheme | None:
    """The activation scheme a group's `input_activations` describe (NONE when absent), or None."""
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


def _covers(targets: tuple[str, ...], probes: tuple[str, ...]) -> bool:
    return any(not naming.is_class_target(t) and naming.target_matches(t, n) for t in targets for n in probes)


def roles(targets: tuple[str, ...]) -> set[str]:
    """The roles ("linear", "moe") a group's targets cover, from probe module names."""
    if "Linear" in targets:
        return {"linear", "moe"}
    found = set()
    if _covers(targets, DENSE_PROBES):
        found.add("linear")
    if _covers(targets, EXPERT_PROBES):
        found.add("moe")
    return found


def _arg_differences(gname: str, which: str, args: Mapping[str, Any] | None) -> list[str]:
    if args is None:
        return []
    key = f"config_groups.{gname}.{which}"
    out = []
    if args.get("symmetric") is False:
        out.append(f"{key}.symmetric is false: asymmetric quantization needs zero points the trainer does not export")
    if which == "weights" and args.get("dynamic") not in (None, False):
        out.append(f"{key}.dynamic={args.get('dynamic')!r}: the trainer exports static weight scales")
    if args.get("actorder") not in (None, False):
        out.append(f"{key}.actorder={args.get('actorder')!r}: GPTQ activation ordering is not exported")
    return out


def _group_differences(qc: Mapping[str, Any], gname: str, group: Mapping[str, Any],
                       fmt: PrecisionFormat, targets: tuple[str, ...]) -> list[str]:
    out = _arg_differences(gname, "weights", _args(group, "weights"))
    out += _arg_differences(gname, "input_activations", _args(group, "input_activations"))
    written = group.get("format") or qc.get("format")
    if written not in (None, fmt.ct_format, "mixed-precision") or group.get("format") not in (None, fmt.ct_format):
        out.append(f"config_groups.{gname}: compression format {written!r} is not {fmt.ct_format!r}, the layout "
                   f"the trainer exports {fmt.name} weights in")
    classes = [t for t in targets if naming.is_class_target(t) and t != "Linear"]
    if classes:
        out.append(f"config_groups.{gname}.targets {classes}: module classes other than 'Linear' cannot be mapped to "
                   "checkpoint names; target 'Linear', layer names or re: patterns")
    if not targets:
        out.append(f"config_groups.{gname}.targets is empty")
    return out


def _top_level_differences(qc: Mapping[str, Any]) -> list[str]:
    out = []
    for field, what in (("sparsity_config", "sparse weights"), ("transform_config", "weight transforms (rotations)")):
        if qc.get(field):
            out.append(f"{field} is set: the trainer does not export {what}")
    status = qc.get("quantization_status")
    if status not in (None, "compressed"):
        out.append(f"quantization_status={status!r}: the trainer sends compressed weights ('compressed')")
    return out


@attrs.frozen
class _Role:
    format: PrecisionFormat
    activation: ActivationScheme
    group: str
    specific: bool


def _choose_roles(groups: list[TargetGroup]) -> tuple[dict[str, _Role], list[str]]:
    chosen: dict[str, _Role] = {}
    conflicts: list[str] = []
    for g in groups:
        specific = "Linear" not in g.targets
        for role in roles(g.targets):
            new = _Role(g.format, g.activation, g.name, specific)
            old = chosen.get(role)
            if old is not None and (old.format, old.activation) != (new.format, new.activation):
                kind = "dense layers" if role == "linear" else "routed experts"
                conflicts.append(f"config_groups {old.group} and {g.name} give {kind} two formats "
                                 f"({old.format.name}/{old.activation.value} and {new.format.name}/{new.activation.value}); "
                                 f"the trainer's plan has one preset for {kind}")
            # a name-matching group beats a class ("Linear") group, as engines resolve targets
            if old is None or (specific and not old.specific):
                chosen[role] = new
    return chosen, conflicts


def _ignore_entries(entries: list[str]) -> tuple[str, ...]:
    implied = {naming.to_engine_pattern(e) for e in naming.DEFAULT_IGNORE} | set(naming.DEFAULT_IGNORE)
    implied.add(naming.EXPERTS_PATTERN)
    return tuple(naming.exact_entry(e) for e in entries if e not in implied)


def read_compressed_tensors(qc: Mapping[str, Any], ignore: tuple[str, ...] = ()) -> CtReading:
    """Read a compressed-tensors quantization_config as written.

    Args:
        qc: the config dict.
        ignore: extra ignore entries (the user's rollout.quantization.ignore).

    Returns:
        The CtReading: the plan (its `targets` set when the groups cover only some Linear
        layers), or why nothing can be exported, and the fields that cannot be honoured.
    """
    raw = qc.get("config_groups")
    if not isinstance(raw, Mapping) or not raw:
        return CtReading(None, "compressed-tensors config without config_groups")
    groups: list[TargetGroup] = []
    differences = _top_level_differences(qc)
    for gname, group in raw.items():
        if not isinstance(group, Mapping):
            return CtReading(None, f"config group {gname!r} is not a dict")
        fmt = weight_format(_args(group, "weights"))
        act = activation_scheme(_args(group, "input_activations"))
        targets = naming.name_list(group.get("targets"))
        if targets is None:
            return CtReading(None, f"config group {gname!r}: targets must be a list of module names, `re:` "
                                   f"patterns or module classes, got {type(group.get('targets')).__name__}")
        if fmt is None or act is None:
            differences.append(f"config_groups.{gname} is not one of the presets {PRESETS} (weights and "
                               "input_activations); the trainer cannot export it")
            continue
        differences += _group_differences(qc, str(gname), group, fmt, targets)
        groups.append(TargetGroup(str(gname), targets, fmt, act))
    if not groups:
        return CtReading(None, f"no config group is one of the presets {PRESETS}", tuple(differences))
    chosen, conflicts = _choose_roles(groups)
    differences += conflicts
    listed = naming.name_list(qc.get("ignore"))
    if listed is None:
        return CtReading(None, f"the config's ignore is not a list of module names or `re:` patterns, got "
                               f"{type(qc.get('ignore')).__name__}", tuple(differences))
    entries = list(listed)
    if any(naming.target_matches(e, n) for e in entries for n in EXPERT_PROBES):
        chosen.pop("moe", None)  # "Linear" with the experts ignored: a dense-only plan
    if not chosen:
        return CtReading(None, "no config group targets Linear layers or experts", tuple(differences))
    lin, moe = chosen.get("linear"), chosen.get("moe")
    standard = all(t in STANDARD_TARGETS for g in groups for t in g.targets)
    plan = QuantizationPlan(
        linear=lin.format if lin else QuantizationPlan().linear,
        moe=moe.format if moe else QuantizationPlan().moe,
        linear_activation=lin.activation if lin and lin.activation is not lin.format.activation else None,
        moe_activation=moe.activation if moe and moe.activation is not moe.format.activation else None,
        ignore=_ignore_entries(entries) + tuple(e for e in ignore if e not in entries),
        targets=() if standard else tuple(groups),
    )
    return CtReading(plan, None, tuple(differences))


# Default-ignored modules that engines still build as quantizable Linear layers: a config that
# targets them is honoured only if the trainer quantizes them too. (Routers and shared-expert
# gates are built without a quantization method by the engines, embeddings and lm_head are not
# Linear layers there: a `Linear` target never reaches them.)
ENGINE_LINEAR_DEFAULTS = (r"re:.*linear_attn\.in_proj_(ba|a|b)$",
                          r"re:(.*\.)?(visual|vision_tower|vision_model|multi_modal_projector)\..*")


def preset_groups(qc: Mapping[str, Any]) -> tuple[TargetGroup, ...]:
    """The config groups that are presets, in the config's order."""
    out = []
    for gname, group in (qc.get("config_groups") or {}).items():
        if isinstance(group, Mapping):
            fmt = weight_format(_args(group, "weights"))
            act = activation_scheme(_args(group, "input_activations"))
            if fmt is not None and act is not None:
                out.append(TargetGroup(str(gname), tuple(str(t) for t in group.get("targets") or ()), fmt, act))
    return tuple(out)


def config_group(qc: Mapping[str, Any], module: str) -> Mapping[str, Any] | None:
    """The config group an engine reading `qc` quantizes the Linear module `module` with: none
    when an ignore entry matches it (exact name or `re:` pattern); else the first group whose
    name or `re:` targets select it (for an expert, also its fused layer `...mlp.experts`), else
    the first that targets `Linear`.

    Args:
        qc: a compressed-tensors quantization_config.
        module: a module name.

    Returns:
        The group's dict, or None when the config keeps the module unquantized.
    """
    names = [module, *([layer] if (layer := naming.experts_layer(module)) else [])]
    if any(naming.target_matches(e, n) for e in naming.name_list(qc.get("ignore")) or () for n in names):
        return None
    raw = qc.get("config_groups")
    groups = [g for g in raw.values() if isinstance(g, Mapping)] if isinstance(raw, Mapping) else []
    targets = [(g, naming.name_list(g.get("targets")) or ()) for g in groups]
    by_name = next((g for g, ts in targets if any(not naming.is_class_target(t) and naming.target_matches(t, n)
                                                  for t in ts for n in names)), None)
    return by_name or next((g for g, ts in targets if "Linear" in ts), None)


def unignored(qc: Mapping[str, Any], bf16_modules: Iterable[str]) -> list[str]:
    """The modules written in BF16 that `qc` would still quantize (its groups reach them and its
    ignore list does not): each must be added to the ignore list, or the config claims a format
    with scales for a tensor that has none.

    Args:
        qc: a compressed-tensors quantization_config.
        bf16_modules: the Linear modules the checkpoint keeps in BF16.

    Returns:
        Those modules, in the order given.
    """
    return [m for m in bf16_modules if config_group(qc, m) is not None]


def _engine_candidate(name: str, shape: tuple[int, ...]) -> tuple[str, str] | None:
    cls = naming.classify(name, tuple(shape))
    if cls.kind != "passthrough":
        return cls.kind, cls.module
    if name.endswith(".weight") and len(shape) == 2 and naming.first_match(ENGINE_LINEAR_DEFAULTS, name):
        return "dense", cls.module
    return None


def model_differences(qc: Mapping[str, Any], plan: QuantizationPlan,
                      shapes: Sequence[tuple[str, tuple[int, ...]]], extra_ignore: Sequence[str] = ()) -> tuple[str, ...]:
    """Tensors the config, as an engine reads it, quantizes differently from the plan.

    The config's reading: its ignore list (exact names, `re:` patterns), then its groups'
    targets; the plan's: plan.decide (rl-refit's default ignore list included).

    Args:
        qc: the compressed-tensors config.
        plan: the plan read from it.
        shapes: the model's (name, shape) pairs.
        extra_ignore: engine patterns appended to the config's ignore list (rollout.quantization.ignore).

    Returns:
        One sentence per kind of difference, with examples and the fix.
    """
    groups = preset_groups(qc)
    ignore = [*(naming.name_list(qc.get("ignore")) or ()), *extra_ignore]
    found: dict[tuple[str, str, str], list[str]] = {}
    for name, shape in shapes:
        candidate = _engine_candidate(name, shape)
        if candidate is None:
            continue
        kind, module = candidate
        names = [module, *([layer] if kind == "expert" and (layer := naming.experts_layer(module)) else [])]
        ignored = any(naming.target_matches(e, n) for e in ignore for n in names)
        group = None if ignored else target_group(groups, kind, module)
        config_fmt = group.format.name if group is not None else "BF16"
        decision = plan.decide(name, tuple(shape))
        if config_fmt != decision.format.name:
            found.setdefault((config_fmt, decision.format.name, decision.reason.split("; ")[-1]), []).append(name)
    out = []
    for (config_fmt, plan_fmt, why), names in found.items():
        default = naming.first_match(naming.DEFAULT_IGNORE, names[0])
        fix = (f"add {default!r} to the config's ignore list" if default is not None and plan_fmt == "BF16"
               else "make the config's groups give each role one preset")
        out.append(f"the config serves {len(names)} tensor(s) in {config_fmt} that the trainer exports in {plan_fmt} "
                   f"({why}; e.g. {', '.join(names[:3])}): {fix}")
    return tuple(out)
