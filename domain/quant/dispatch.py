"""The dispatch rules, each known by its name and documented under it in docs/plan.md
(docs/plan.md#the-dispatch-rules): an ordered list of rule objects.

`resolve` first applies the rules on the settings alone (QatExcludesTeRecipe), then decides where
the rollout quantization comes from (NativeReleaseLayout, UnexportableNativeMethod, and
ConfigAsWritten: whether a compressed-tensors config reaches the engine as written), then applies
the rules in order to the resolved DispatchContext and returns the Resolution: the plan the
trainer exports, where it came from, the checkpoint layout the engine gets, and every rule's
outcome in words (what `refit plan` prints). The rules on single settings are the functions of
domain.quant.rules, EngineSupportMatrix applies the engine's support table (domain.quant.support),
the model's rules are domain.quant.model_rules; the rules only some engines have come with the
engine's EngineDispatch (domain.quant.dispatch_types), from its adapter's profile.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from domain.errors import (
    ConfigNotHonoured,
    NativeLayoutOverride,
    NativeRefitUnsupported,
    UnsupportedCombination,
    UnsupportedQuantMethod,
)
from domain.keys import key
from domain.quant import modelopt_layout, naming
from domain.quant.ct_config import model_differences
from domain.quant.dispatch_types import (
    PURPOSES,
    DispatchContext,
    DispatchInput,
    EngineDispatch,
    Resolution,
    Rule,
    RuleOutcome,
)
from domain.quant.model_rules import (
    Shapes,
    bf16_training_layers,
    check_block_divisible,
    check_boundary_layers,
    check_fused_groups,
    check_qat_ignore,
)
from domain.quant.native_config import (
    OVERRIDE_ABSENT,
    NativeConfig,
    find_quantization_config,
    override_quantization_config,
    parse_quantization_config,
)
from domain.quant.plan import QuantizationPlan
from domain.quant.rules import (
    check_qat_mode,
    check_qat_te_recipe,
    check_static_activations,
    check_sync_backend,
)
from domain.quant.support import COMPRESSED_TENSORS, NATIVE_PASSTHROUGH, Verdict, is_engine_native

__all__ = [
    "PURPOSES", "DispatchContext", "DispatchInput", "EngineDispatch", "Resolution", "Rule", "RuleOutcome",
    "check_qat_mode", "check_qat_te_recipe", "check_static_activations", "check_sync_backend", "resolve",
    "rule_names", "rules_for",
]

# The rules that decide where the quantization comes from. They choose a source rather than check
# a context, so they are steps of `resolve`, not Rule objects; each has its name all the same.
NATIVE_RELEASE_LAYOUT = "NativeReleaseLayout"
UNEXPORTABLE_NATIVE_METHOD = "UnexportableNativeMethod"
CONFIG_AS_WRITTEN = "ConfigAsWritten"
SOURCE_RULES = (NATIVE_RELEASE_LAYOUT, UNEXPORTABLE_NATIVE_METHOD, CONFIG_AS_WRITTEN)

# Models whose own exporter emits the release quantized layout (NativeReleaseLayout).
RELEASE_LAYOUT_MODEL_TYPES = ("deepseek_v4",)
RELEASE_LAYOUT_ARCHITECTURES = ("DeepseekV4ForCausalLM",)
CONFIG_FILE_KEY = key("quantization", "config_file")
_REQUESTED_KEY = key("quantization", "linear/moe")


# --- source selection: NativeReleaseLayout and UnexportableNativeMethod -------------------------------


def is_release_layout_model(model_config: Mapping[str, Any] | None) -> bool:
    """Whether the model's exporter already emits its release quantized layout (DeepSeek-V4).

    Args:
        model_config: the checkpoint's config.json, or None.

    Returns:
        True for the model types / architectures listed in RELEASE_LAYOUT_*.
    """
    if not model_config:
        return False
    archs = model_config.get("architectures") or ()
    return model_config.get("model_type") in RELEASE_LAYOUT_MODEL_TYPES or any(
        a in RELEASE_LAYOUT_ARCHITECTURES for a in archs
    )


def check_release_layout(inp: DispatchInput, override: object) -> bool:
    """NativeReleaseLayout: a model whose exporter emits the release layout accepts no override
    (docs/plan.md#nativereleaselayout).

    Args:
        inp: the dispatch input.
        override: the hf_overrides quantization_config (OVERRIDE_ABSENT when not set).

    Returns:
        True when the rule applies (the native config then passes through unchanged).
        Raises NativeLayoutOverride when an override or a rollout quantization is given.
    """
    if not is_release_layout_model(inp.model_config):
        return False
    asked = [k for k, on in (
        (inp.hf_overrides_key + ".quantization_config", override is not OVERRIDE_ABSENT),
        (_REQUESTED_KEY, inp.requested is not None),
        (CONFIG_FILE_KEY, inp.config_file is not None),
    ) if on]
    if asked:
        raise NativeLayoutOverride(
            f"{(inp.model_config or {}).get('model_type', 'this model')} checkpoints are exported in their "
            f"release quantized layout; remove {', '.join(asked)} (its native quantization_config is used as is)"
        )
    return True


def check_unsupported_method(native: NativeConfig, *, source: str, qat_enable: bool) -> bool:
    """UnexportableNativeMethod: a quantization method the trainer cannot export
    (docs/plan.md#unexportablenativemethod).

    Args:
        native: the parsed quantization_config.
        source: where it came from ("checkpoint", "hf_overrides", "config_file").
        qat_enable: actor.megatron.qat.enable.

    Returns:
        True when the native weights pass through untouched (checkpoint config, no QAT);
        False when the method is exportable. Raises UnsupportedQuantMethod when the method was
        asked for explicitly (override or config file) or QAT is on.
    """
    if native.exportable:
        return False
    if source == "checkpoint" and not qat_enable:
        return True
    why = f"{key('qat', 'enable')} is true" if qat_enable and source == "checkpoint" else f"it is requested by {source}"
    raise UnsupportedQuantMethod(
        f"quantization method {native.method!r} cannot be produced by the trainer ({native.problem}), and "
        f"{why}; use one of FP8_BLOCK, MXFP8, MXFP4, NVFP4 in {key('rollout', 'quantization')}, or drop the override"
        " and QAT to serve the checkpoint's native weights unchanged"
    )


def check_native_refit(native: NativeConfig, *, purpose: str) -> None:
    """UnexportableNativeMethod for refits: a native layout the trainer cannot produce cannot be
    refitted (docs/plan.md#unexportablenativemethod).

    The engine would be configured with the checkpoint's own quantization_config while the refit
    sends the trainer's BF16 tensors, which that layout cannot load (GPT-OSS's mxfp4 experts are
    `*_blocks` / `*_scales`). `refit export` copies such a checkpoint as it is.

    Args:
        native: the checkpoint's quantization_config, not exportable.
        purpose: "refit" or "export".

    Returns:
        None. Raises NativeRefitUnsupported for a refit.
    """
    if purpose != "refit":
        return
    raise NativeRefitUnsupported(
        f"the checkpoint's quantization_config (quant_method {native.method!r}) is a layout the trainer cannot "
        f"produce ({native.problem}); a refit would configure the engine for it and send BF16 tensors it cannot "
        f"load (dispatch rule {UNEXPORTABLE_NATIVE_METHOD}). Serve a quantization the trainer exports "
        f"(e.g. {key('quantization', 'moe')}=MXFP4, with load_format=dummy), or BF16 (set {key('engine_kwargs', '<engine>', 'hf_overrides')}.quantization_config="
        "null)"
    )


def _num_layers(model_config: Mapping[str, Any] | None, shapes: Shapes) -> int:
    for cfg in (model_config or {}, (model_config or {}).get("text_config") or {}):
        if isinstance(cfg.get("num_hidden_layers"), int):
            return cfg["num_hidden_layers"]
    layers = [i for n, _ in shapes if (i := naming.layer_index(n)) is not None]
    return max(layers) + 1 if layers else 0


def _with_ignore(plan: QuantizationPlan, inp: DispatchInput) -> QuantizationPlan:
    extra = tuple(e for e in inp.ignore if e not in plan.ignore)
    return attrs.evolve(plan, ignore=plan.ignore + extra) if extra else plan


def layout_for(engine: EngineDispatch, plan: QuantizationPlan, native: NativeConfig | None) -> str:
    """The checkpoint layout the engine reads (its own native layouts included).

    Args:
        engine: the engine's part in the rules (its profile's EngineDispatch).
        plan: the resolved plan.
        native: the native config the plan came from, if any.

    Returns:
        "bf16", "compressed-tensors", "native-fp8" or the engine's own native layout.
    """
    return engine.layout_for(plan, native)


def _select(inp: DispatchInput, override: object) -> tuple[str, QuantizationPlan, NativeConfig | None]:
    requested = [k for k, on in ((_REQUESTED_KEY, inp.requested is not None),
                                 (CONFIG_FILE_KEY, inp.config_file is not None),
                                 (inp.hf_overrides_key + ".quantization_config", override is not OVERRIDE_ABSENT))
                 if on]
    if len(requested) > 1:
        raise UnsupportedCombination(f"{' and '.join(requested)} are both set; set only one of them")
    if override is not OVERRIDE_ABSENT:
        if not isinstance(override, Mapping):
            return "hf_overrides", QuantizationPlan.bf16(), None
        where = f"{inp.hf_overrides_key}.quantization_config"
        return _from_native(parse_quantization_config(override, ignore=inp.ignore, key=where), "hf_overrides", inp)
    if inp.config_file is not None:
        native = parse_quantization_config(inp.config_file, ignore=inp.ignore, key=CONFIG_FILE_KEY)
        return _from_native(native, "config_file", inp)
    if inp.requested is not None:
        return key("rollout", "quantization"), _with_ignore(inp.requested, inp), None
    found = find_quantization_config(inp.model_config)
    if found is None:
        return "none", QuantizationPlan.bf16(), None
    native = parse_quantization_config(found[1], ignore=inp.ignore, key=_checkpoint_key(found[0]))
    return _from_native(native, "checkpoint", inp)


def _checkpoint_key(where: str) -> str:
    return f"{key('model', 'path')} (config.json {where})"


def _from_native(native: NativeConfig, source: str, inp: DispatchInput) -> tuple[str, QuantizationPlan, NativeConfig]:
    check_unsupported_method(native, source=source, qat_enable=inp.qat_enable)
    return source, native.plan or QuantizationPlan.bf16(), native


@attrs.frozen
class _Source:
    source: str
    plan: QuantizationPlan
    native: NativeConfig | None
    layout: str

    @property
    def served(self) -> QuantizationPlan | None:
        if self.layout == NATIVE_PASSTHROUGH:
            return self.native.plan if self.native is not None else None
        return self.plan


def _source(inp: DispatchInput, engine: EngineDispatch, override: object, outcomes: list[RuleOutcome]) -> _Source:
    """NativeReleaseLayout and UnexportableNativeMethod: where the rollout quantization comes from.
    Never the end of the rules."""
    release, unexportable = ((NATIVE_RELEASE_LAYOUT, "release layout"),
                             (UNEXPORTABLE_NATIVE_METHOD, "unsupported native method"))
    if check_release_layout(inp, override):
        found = find_quantization_config(inp.model_config)
        if found is None:
            outcomes.append(RuleOutcome(*release, "BF16 checkpoint: nothing to pass through"))
            outcomes.append(RuleOutcome(*unexportable, "n/a: the model's exporter emits its layout"))
            return _Source("none", QuantizationPlan.bf16(), None, "bf16")
        outcomes.append(RuleOutcome(*release, "the model's exporter emits it; the native "
                                              "quantization_config passes through unchanged"))
        outcomes.append(RuleOutcome(*unexportable, "n/a: the model's exporter emits its layout"))
        emitted = parse_quantization_config(found[1], key=_checkpoint_key(found[0]))
        return _Source("checkpoint", QuantizationPlan.bf16(), emitted, NATIVE_PASSTHROUGH)
    outcomes.append(RuleOutcome(*release, "n/a"))
    source, plan, native = _select(inp, override)
    if native is not None and not native.exportable:
        check_native_refit(native, purpose=inp.purpose)
        outcomes.append(RuleOutcome(*unexportable, f"{native.method!r} is copied untouched (export)"))
        return _Source(source, plan, native, NATIVE_PASSTHROUGH)
    outcomes.append(RuleOutcome(*unexportable, "n/a"))
    return _Source(source, plan, native, engine.layout_for(plan, native))


def _as_written_note(inp: DispatchInput, native: NativeConfig, checked: bool) -> str:
    notes = ["the engine receives it as written"]
    if native.config.get("kv_cache_scheme"):
        notes.append("kv_cache_scheme kept: the engine keeps the KV-cache scales it loaded (a refit sends none and "
                     "does not reset them)")
    if inp.ignore:
        notes.append(f"{key('quantization', 'ignore')} appended to its ignore list")
    if not checked:
        notes.append("per-tensor check skipped: no model given")
    return "; ".join(notes)


def _honour(inp: DispatchInput, src: _Source, shapes: Shapes | None,
            outcomes: list[RuleOutcome]) -> tuple[QuantizationPlan, bool]:
    """ConfigAsWritten: a compressed-tensors config reaches the engine as written, or (allowed)
    rewritten (docs/plan.md#configaswritten).

    Returns:
        (the plan, whether the config is sent as written). Raises ConfigNotHonoured listing the
        fields that cannot be honoured when a user's config may not be rewritten.
    """
    native = src.native
    rule = (CONFIG_AS_WRITTEN, "config as written")
    if native is None or not native.is_compressed_tensors or src.layout == NATIVE_PASSTHROUGH:
        outcomes.append(RuleOutcome(*rule, "n/a"))
        return src.plan, False
    differences = list(native.differences)
    if src.layout != COMPRESSED_TENSORS:
        differences.append(f"{key('rollout', 'name')}={inp.engine} serves this plan in its {src.layout} layout, "
                           "not as compressed-tensors")
    if shapes is not None and not differences:
        extra = [naming.to_engine_pattern(e) for e in inp.ignore]
        differences += model_differences(native.config, src.plan, shapes, extra)
    if not differences:
        outcomes.append(RuleOutcome(*rule, _as_written_note(inp, native, shapes is not None)))
        return src.plan, True
    # A checkpoint's own config was not written by the user: it is rewritten, with every change listed.
    if not (inp.allow_config_rewrite or src.source == "checkpoint"):
        raise ConfigNotHonoured(
            f"the {src.source} quantization_config cannot reach the engine as written: {'; '.join(differences)}. "
            f"Fix the config, or set {key('quantization', 'allow_config_rewrite')}=true to send the config the "
            "trainer exports (rebuilt from its presets; kv_cache_scheme kept)",
            differences=tuple(differences),
        )
    outcomes.append(RuleOutcome(*rule, "rewritten from the presets (kv_cache_scheme kept): " + "; ".join(differences)))
    return attrs.evolve(src.plan, targets=()), False


# --- the rules, in the order they run ---------------------------------------------------------------


def _support_cells(ctx: DispatchContext) -> list[Verdict]:
    table = ctx.engine.support
    if table is None or ctx.served is None:
        return []
    return table.check(ctx.served, ctx.layout)


def _check_support(ctx: DispatchContext) -> None:
    _support_cells(ctx)


def _support_note(ctx: DispatchContext) -> str:
    shown = _support_cells(ctx)
    if not shown:
        return "n/a"
    cells = ", ".join(f"{v.cell.role} {v.cell.fmt}/{v.cell.activation.value}" for v in shown)
    notes = [f"{v.cell.role}: {v.note}" for v in shown if v.note]
    return f"ok: {cells} shown for {ctx.engine.name} (docs/support-matrix.md)" + "".join(f"; {n}" for n in notes)


def _training_bf16(ctx: DispatchContext, shapes: Shapes) -> set[int]:
    inp = ctx.inp
    return bf16_training_layers(
        _num_layers(inp.model_config, shapes),
        # NVFP4 training keeps them BF16 either through Transformer Engine's FP4 recipe or QAT.
        enabled=inp.first_last_layers_bf16 and (inp.qat_enable or inp.te_fp4 not in (None, False, "")),
        at_start=inp.num_layers_at_start_in_bf16,
        at_end=inp.num_layers_at_end_in_bf16,
    )


def _fused_groups(ctx: DispatchContext) -> None:
    if ctx.shapes is None:
        return
    check_fused_groups(ctx.plan, ctx.shapes)
    if ctx.inp.qat_enable:
        check_qat_ignore(ctx.plan, ctx.shapes, ctx.inp.qat_ignore)


def _boundary_layers(ctx: DispatchContext) -> None:
    if ctx.shapes is not None:
        check_boundary_layers(ctx.plan, ctx.shapes, _training_bf16(ctx, ctx.shapes))


def _boundary_note(ctx: DispatchContext) -> str:
    if ctx.shapes is None:
        return "skipped: no model given"
    training_bf16 = _training_bf16(ctx, ctx.shapes)
    return f"training BF16 layers {sorted(training_bf16)} are BF16 in the rollout" if training_bf16 else "n/a"


def _block_divisible(ctx: DispatchContext) -> None:
    if ctx.shapes is not None:
        check_block_divisible(ctx.plan, ctx.shapes)


def _block_note(ctx: DispatchContext) -> str:
    if ctx.shapes is None:
        return "skipped: no model given"
    return "ok" if ctx.plan.is_quantized else "n/a"


# The rules on the settings alone, before the source of the quantization is decided.
SETTINGS_RULES: tuple[Rule, ...] = (
    Rule("QatExcludesTeRecipe", "QAT vs TE recipe",
         lambda c: check_qat_te_recipe(qat_enable=c.inp.qat_enable, te_fp8=c.inp.te_fp8, te_fp4=c.inp.te_fp4)),
)
# The rules on the resolution, before the engine's own.
RESOLUTION_RULES: tuple[Rule, ...] = (
    Rule("QatMatchesRollout", "QAT mode", lambda c: check_qat_mode(c.served, qat_enable=c.inp.qat_enable, qat_mode=c.inp.qat_mode),
         lambda c: "ok" if c.inp.qat_enable else "n/a"),
    Rule("QuantizedFullSync", "sync backend",
         lambda c: check_sync_backend(c.quantized, backend=c.inp.sync_backend, wire_format=c.inp.wire_format),
         lambda c: "ok" if c.quantized else "n/a"),
    Rule("DynamicActivationsOnly", "static activations", lambda c: check_static_activations(c.plan),
         lambda c: "ok" if c.plan.is_quantized else "n/a"),
    Rule("EngineSupportMatrix", "engine support matrix", _check_support, _support_note),
)
# The rules on the model's tensors, after the engine's own (each skipped when no model is given).
MODEL_RULES: tuple[Rule, ...] = (
    Rule("UniformFusedGroups", "fused groups", _fused_groups,
         lambda c: "ok: every q/k/v and gate/up group is uniform" if c.shapes is not None else "skipped: no model given"),
    Rule("FirstLastLayersBf16", "first/last BF16 layers", _boundary_layers, _boundary_note),
    Rule("BlockDivisibility", "block-divisible K", _block_divisible, _block_note),
)


def rules_for(engine: EngineDispatch) -> tuple[Rule, ...]:
    """The ordered rules a resolution for `engine` runs through (after the settings rules).

    Args:
        engine: the engine's part in the rules.

    Returns:
        RESOLUTION_RULES, then the engine's rules, then MODEL_RULES.
    """
    return (*RESOLUTION_RULES, *engine.rules, *MODEL_RULES)


def rule_names(engine: EngineDispatch) -> tuple[str, ...]:
    """Every rule a resolution for `engine` runs, by name, in the order it runs them.

    Args:
        engine: the engine's part in the rules.

    Returns:
        The settings rules, the source rules (SOURCE_RULES), then rules_for(engine).
    """
    return tuple(r.name for r in SETTINGS_RULES) + SOURCE_RULES + tuple(r.name for r in rules_for(engine))


def _apply(rules: tuple[Rule, ...], ctx: DispatchContext, outcomes: list[RuleOutcome]) -> None:
    for rule in rules:
        if not rule.applies(ctx):
            outcomes.append(RuleOutcome(rule.name, rule.summary, "n/a"))
            continue
        rule.check(ctx)
        outcome = rule.outcome(ctx)
        if outcome is not None:
            outcomes.append(RuleOutcome(rule.name, rule.summary, outcome))


def resolve(inp: DispatchInput, shapes: Shapes | None = None, *, engine: EngineDispatch) -> Resolution:
    """Apply every dispatch rule and decide the rollout's quantization.

    Precedence: an engine hf_overrides `quantization_config` (null = BF16), a config_file, or
    rollout.quantization.linear/moe (at most one of these three), else the checkpoint's own
    quantization_config (top level or under text_config), else BF16. Every rule runs for every
    source and model: a release-layout model (NativeReleaseLayout) or a native pass-through
    (UnexportableNativeMethod) only decides where the quantization comes from.

    Args:
        inp: the settings.
        shapes: the model's (name, shape) pairs; the model's rules (UniformFusedGroups,
            FirstLastLayersBf16, BlockDivisibility) and the per-tensor check of a compressed-tensors
            config run only when given.
        engine: the engine's part in the rules (its adapter profile's EngineDispatch), named as
            `inp.engine`.

    Returns:
        The Resolution, its outcomes in the order the rules ran. Raises the rule's typed error
        on the first rule that rejects.
    """
    if engine.name != inp.engine:
        raise ValueError(f"the dispatch input is for {key('rollout', 'name')}={inp.engine}, "
                         f"but the engine rules given are {engine.name}'s")
    override = override_quantization_config(inp.hf_overrides, inp.hf_overrides_key)
    outcomes: list[RuleOutcome] = []
    _apply(SETTINGS_RULES, DispatchContext(inp, engine, shapes), outcomes)
    src = _source(inp, engine, override, outcomes)
    plan, as_written = _honour(inp, src, shapes, outcomes)
    served = src.served if src.layout == NATIVE_PASSTHROUGH else plan
    quantized = plan.is_quantized or src.layout == NATIVE_PASSTHROUGH
    ctx = DispatchContext(inp, engine, shapes, plan, served, src.layout, quantized)
    _apply(rules_for(engine), ctx, outcomes)
    if is_engine_native(src.layout):
        plan = attrs.evolve(plan, scale_name="weight_scale_inv")
    if src.layout == modelopt_layout.LAYOUT:
        plan = attrs.evolve(plan, expert_layout="modelopt")
    return Resolution(plan, src.source, src.layout, src.native, tuple(outcomes),
                      served=served, as_written=as_written)
