"""Dispatch rules (ARCHITECTURE.md section 4): each a pure function raising a typed error.

`resolve` applies them in order to one DispatchInput and returns the Resolution: the plan the
trainer exports, where it came from, the checkpoint layout the engine gets, and every rule's
outcome in words (what `refit plan` prints). Rules 1 and 3 (where the quantization comes from)
live here; the rules on single settings (2, 4, 5, 7) in domain.quant.rules, re-exported; rule 6,
the engines' support matrix, in domain.quant.support.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from domain.errors import (
    ConfigNotHonoured,
    NativeLayoutOverride,
    NativeRefitUnsupported,
    UnsupportedCombination,
    UnsupportedQuantMethod,
)
from domain.quant import naming
from domain.quant.ct_config import model_differences
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
    check_trtllm,
)
from domain.quant.rules import check_sglang as check_sglang  # re-exported: the SGLang adapter's check
from domain.quant.support import SUPPORT_ENGINES, Verdict, check_cells, default_layout

ENGINES = ("vllm", "sglang", "trtllm", "reference")
# Models whose own exporter emits the release quantized layout (rule 3).
RELEASE_LAYOUT_MODEL_TYPES = ("deepseek_v4",)
RELEASE_LAYOUT_ARCHITECTURES = ("DeepseekV4ForCausalLM",)
# What the resolution is for: a refit (the trainer's tensors reach a live engine) or `refit
# export` (a checkpoint on disk; a native layout the trainer cannot produce is copied as it is).
PURPOSES = ("refit", "export")
CONFIG_FILE_KEY = "rollout.quantization.config_file"



def _names(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(items)

@attrs.frozen
class DispatchInput:
    """Everything the dispatch rules look at, as plain values (built by app from the config).

    Attributes:
        engine: rollout.name.
        requested: the plan from rollout.quantization.{linear, moe, ...}; None when neither is set.
        ignore: rollout.quantization.ignore (applied to every plan, whatever its source).
        config_file: the parsed rollout.quantization.config_file, or None.
        hf_overrides: the engine's hf_overrides (dict or JSON string), or None.
        hf_overrides_key: its configuration key, for messages.
        model_config: the checkpoint's config.json, or None.
        qat_enable, qat_mode, qat_ignore: actor.megatron.qat.{enable, mode, ignore_patterns}.
        te_fp8, te_fp4: actor.megatron.override_transformer_config.{fp8, fp4} (None = off).
        first_last_layers_bf16, num_layers_at_start_in_bf16, num_layers_at_end_in_bf16: the
            Megatron settings that keep boundary layers BF16 in low-precision training.
        sync_backend: rollout.checkpoint_engine.backend.
        wire_format: rollout.wire_format.
        allow_config_rewrite: rollout.quantization.allow_config_rewrite: a user's compressed-
            tensors config that cannot be honoured as written is rewritten instead of rejected.
        purpose: "refit" or "export" (see PURPOSES).
    """

    engine: str = attrs.field(default="reference", validator=attrs.validators.in_(ENGINES))
    requested: QuantizationPlan | None = None
    ignore: tuple[str, ...] = attrs.field(default=(), converter=_names)
    config_file: Mapping[str, Any] | None = None
    hf_overrides: Mapping[str, Any] | str | None = None
    hf_overrides_key: str = "rollout.engine_kwargs.vllm.hf_overrides"
    model_config: Mapping[str, Any] | None = None
    qat_enable: bool = False
    qat_mode: str | None = None
    qat_ignore: tuple[str, ...] = attrs.field(default=(), converter=_names)
    te_fp8: object = None
    te_fp4: object = None
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    sync_backend: str | None = None
    wire_format: str | None = None
    allow_config_rewrite: bool = False
    purpose: str = attrs.field(default="refit", validator=attrs.validators.in_(PURPOSES))


@attrs.frozen
class RuleOutcome:
    """One rule's verdict: `rule` is its number (0 for the unnumbered checks)."""

    rule: int
    name: str
    outcome: str


@attrs.frozen
class Resolution:
    """What the dispatch decided.

    Attributes:
        plan: the plan the trainer exports (BF16 when nothing is quantized by the trainer).
        source: "none" | "rollout.quantization" | "config_file" | "hf_overrides" | "checkpoint".
        layout: "bf16" | "compressed-tensors" | "sglang-mxfp8" | "native-fp8" | "native-passthrough".
        native: the quantization_config the plan came from (passed to the engine unchanged for
            native layouts, and as written for compressed-tensors ones when `as_written`), or None.
        outcomes: each rule's verdict, in order.
        served: what the engine serves: the trainer's plan, or what a native layout amounts to
            (None when no preset describes it, e.g. GPT-OSS's mxfp4).
        as_written: the compressed-tensors config `native` reaches the engine as written.
    """

    plan: QuantizationPlan
    source: str
    layout: str
    native: NativeConfig | None
    outcomes: tuple[RuleOutcome, ...]
    served: QuantizationPlan | None = None
    as_written: bool = False

    @property
    def is_quantized(self) -> bool:
        """True when the rollout serves quantized weights (trainer-made or native)."""
        return self.plan.is_quantized or self.layout == "native-passthrough"


# --- source selection and rules 1 and 3 -------------------------------------------------------


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
    """Rule 3: a model whose exporter emits the release layout accepts no override.

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
        ("rollout.quantization.linear/moe", inp.requested is not None),
        ("rollout.quantization.config_file", inp.config_file is not None),
    ) if on]
    if asked:
        raise NativeLayoutOverride(
            f"{(inp.model_config or {}).get('model_type', 'this model')} checkpoints are exported in their "
            f"release quantized layout; remove {', '.join(asked)} (its native quantization_config is used as is)"
        )
    return True


def check_unsupported_method(native: NativeConfig, *, source: str, qat_enable: bool) -> bool:
    """Rule 1: a quantization method the trainer cannot export.

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
    why = "actor.megatron.qat.enable is true" if qat_enable and source == "checkpoint" else f"it is requested by {source}"
    raise UnsupportedQuantMethod(
        f"quantization method {native.method!r} cannot be produced by the trainer ({native.problem}), and "
        f"{why}; use one of FP8_BLOCK, MXFP8, MXFP4, NVFP4 in rollout.quantization, or drop the override"
        " and QAT to serve the checkpoint's native weights unchanged"
    )


def check_native_refit(native: NativeConfig, *, purpose: str) -> None:
    """Rule 1 for refits: a native layout the trainer cannot produce cannot be refitted.

    The engine would be configured with the checkpoint's own quantization_config while the refit
    sends the trainer's BF16 tensors, which that layout cannot load (GPT-OSS's mxfp4 experts are
    `*_blocks` / `*_scales`). `refit export` copies such a checkpoint as it is.

    Args:
        native: the checkpoint's quantization_config, not exportable.
        purpose: "refit" or "export".

    Returns:
        None. Raises NativeRefitUnsupported (dispatch rule 1) for a refit.
    """
    if purpose != "refit":
        return
    raise NativeRefitUnsupported(
        f"the checkpoint's quantization_config (quant_method {native.method!r}) is a layout the trainer cannot "
        f"produce ({native.problem}); a refit would configure the engine for it and send BF16 tensors it cannot "
        "load (dispatch rule 1). Serve a quantization the trainer exports (e.g. rollout.quantization.moe=MXFP4, "
        "with load_format=dummy), or BF16 (set rollout.engine_kwargs.<engine>.hf_overrides.quantization_config="
        "null)"
    )


def _num_layers(model_config: Mapping[str, Any] | None, shapes: Shapes) -> int:
    for cfg in (model_config or {}, (model_config or {}).get("text_config") or {}):
        if isinstance(cfg.get("num_hidden_layers"), int):
            return cfg["num_hidden_layers"]
    layers = [i for n, _ in shapes if (i := naming.layer_index(n)) is not None]
    return max(layers) + 1 if layers else 0


def check_model(inp: DispatchInput, plan: QuantizationPlan, shapes: Shapes) -> list[RuleOutcome]:
    """The checks that need the model's tensors: fused groups, rule 8 and rule 9.

    Args:
        inp: the dispatch input.
        plan: the resolved plan.
        shapes: every tensor's (name, shape).

    Returns:
        Their outcomes. Raises on the first failure.
    """
    check_fused_groups(plan, shapes)
    if inp.qat_enable:
        check_qat_ignore(plan, shapes, inp.qat_ignore)
    training_bf16 = bf16_training_layers(
        _num_layers(inp.model_config, shapes),
        # NVFP4 training keeps them BF16 either through Transformer Engine's FP4 recipe or QAT.
        enabled=inp.first_last_layers_bf16 and (inp.qat_enable or inp.te_fp4 not in (None, False, "")),
        at_start=inp.num_layers_at_start_in_bf16,
        at_end=inp.num_layers_at_end_in_bf16,
    )
    check_boundary_layers(plan, shapes, training_bf16)
    check_block_divisible(plan, shapes)
    bf16_note = f"training BF16 layers {sorted(training_bf16)} are BF16 in the rollout" if training_bf16 else "n/a"
    return [
        RuleOutcome(0, "fused groups", "ok: every q/k/v and gate/up group is uniform"),
        RuleOutcome(8, "first/last BF16 layers", bf16_note),
        RuleOutcome(9, "block-divisible K", "ok" if plan.is_quantized else "n/a"),
    ]


def _with_ignore(plan: QuantizationPlan, inp: DispatchInput) -> QuantizationPlan:
    extra = tuple(e for e in inp.ignore if e not in plan.ignore)
    return attrs.evolve(plan, ignore=plan.ignore + extra) if extra else plan


def layout_for(engine: str, plan: QuantizationPlan, native: NativeConfig | None) -> str:
    """The checkpoint layout the engine reads (SGLang's native MXFP8 translation included).

    Args:
        engine: rollout.name.
        plan: the resolved plan.
        native: the native config the plan came from, if any.

    Returns:
        "bf16", "compressed-tensors", "sglang-mxfp8" or "native-fp8".
    """
    if not plan.is_quantized:
        return "bf16"
    if native is not None and native.method == "fp8":
        return "native-fp8"
    if native is not None and native.method == "mxfp8":
        return "sglang-mxfp8"
    return default_layout(engine, plan)


def _select(inp: DispatchInput, override: object) -> tuple[str, QuantizationPlan, NativeConfig | None]:
    requested = [k for k, on in (("rollout.quantization.linear/moe", inp.requested is not None),
                                 ("rollout.quantization.config_file", inp.config_file is not None),
                                 (inp.hf_overrides_key + ".quantization_config", override is not OVERRIDE_ABSENT))
                 if on]
    if len(requested) > 1:
        raise UnsupportedCombination(f"{' and '.join(requested)} are both set; set only one of them")
    if override is not OVERRIDE_ABSENT:
        if not isinstance(override, Mapping):
            return "hf_overrides", QuantizationPlan.bf16(), None
        key = f"{inp.hf_overrides_key}.quantization_config"
        return _from_native(parse_quantization_config(override, ignore=inp.ignore, key=key), "hf_overrides", inp)
    if inp.config_file is not None:
        native = parse_quantization_config(inp.config_file, ignore=inp.ignore, key=CONFIG_FILE_KEY)
        return _from_native(native, "config_file", inp)
    if inp.requested is not None:
        return "rollout.quantization", _with_ignore(inp.requested, inp), None
    found = find_quantization_config(inp.model_config)
    if found is None:
        return "none", QuantizationPlan.bf16(), None
    native = parse_quantization_config(found[1], ignore=inp.ignore, key=_checkpoint_key(found[0]))
    return _from_native(native, "checkpoint", inp)


def _checkpoint_key(where: str) -> str:
    return f"model.path (config.json {where})"


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
        if self.layout == "native-passthrough":
            return self.native.plan if self.native is not None else None
        return self.plan


def _source(inp: DispatchInput, override: object, outcomes: list[RuleOutcome]) -> _Source:
    """Rules 3 and 1: where the rollout quantization comes from. Never the end of the rules."""
    if check_release_layout(inp, override):
        found = find_quantization_config(inp.model_config)
        outcomes.append(RuleOutcome(1, "unsupported native method", "n/a: the model's exporter emits its layout"))
        if found is None:
            outcomes.append(RuleOutcome(3, "release layout", "BF16 checkpoint: nothing to pass through"))
            return _Source("none", QuantizationPlan.bf16(), None, "bf16")
        outcomes.append(RuleOutcome(3, "release layout", "the model's exporter emits it; the native "
                                                         "quantization_config passes through unchanged"))
        release = parse_quantization_config(found[1], key=_checkpoint_key(found[0]))
        return _Source("checkpoint", QuantizationPlan.bf16(), release, "native-passthrough")
    outcomes.append(RuleOutcome(3, "release layout", "n/a"))
    source, plan, native = _select(inp, override)
    if native is not None and not native.exportable:
        check_native_refit(native, purpose=inp.purpose)
        outcomes.append(RuleOutcome(1, "unsupported native method", f"{native.method!r} is copied untouched (export)"))
        return _Source(source, plan, native, "native-passthrough")
    outcomes.append(RuleOutcome(1, "unsupported native method", "n/a"))
    return _Source(source, plan, native, layout_for(inp.engine, plan, native))


def _as_written_note(inp: DispatchInput, native: NativeConfig, checked: bool) -> str:
    notes = ["the engine receives it as written"]
    if native.config.get("kv_cache_scheme"):
        notes.append("kv_cache_scheme kept: the engine keeps the KV-cache scales it loaded (a refit sends none and "
                     "does not reset them)")
    if inp.ignore:
        notes.append("rollout.quantization.ignore appended to its ignore list")
    if not checked:
        notes.append("per-tensor check skipped: no model given")
    return "; ".join(notes)


def _honour(inp: DispatchInput, src: _Source, shapes: Shapes | None,
            outcomes: list[RuleOutcome]) -> tuple[QuantizationPlan, bool]:
    """A compressed-tensors config reaches the engine as written, or (allowed) rewritten.

    Returns:
        (the plan, whether the config is sent as written). Raises ConfigNotHonoured listing the
        fields that cannot be honoured when a user's config may not be rewritten.
    """
    native = src.native
    name = "config as written"
    if native is None or not native.is_compressed_tensors or src.layout == "native-passthrough":
        outcomes.append(RuleOutcome(0, name, "n/a"))
        return src.plan, False
    differences = list(native.differences)
    if src.layout != "compressed-tensors":
        differences.append(f"rollout.name={inp.engine} serves this plan in its {src.layout} layout, not as "
                           "compressed-tensors")
    if shapes is not None and not differences:
        extra = [naming.to_engine_pattern(e) for e in inp.ignore]
        differences += model_differences(native.config, src.plan, shapes, extra)
    if not differences:
        outcomes.append(RuleOutcome(0, name, _as_written_note(inp, native, shapes is not None)))
        return src.plan, True
    # A checkpoint's own config was not written by the user: it is rewritten, with every change listed.
    if not (inp.allow_config_rewrite or src.source == "checkpoint"):
        raise ConfigNotHonoured(
            f"the {src.source} quantization_config cannot reach the engine as written: {'; '.join(differences)}. "
            "Fix the config, or set rollout.quantization.allow_config_rewrite=true to send the config the trainer "
            "exports (rebuilt from its presets; kv_cache_scheme kept)",
            differences=tuple(differences),
        )
    outcomes.append(RuleOutcome(0, name, "rewritten from the presets (kv_cache_scheme kept): " + "; ".join(differences)))
    return attrs.evolve(src.plan, targets=()), False


def _support_note(engine: str, shown: list[Verdict]) -> str:
    if engine not in SUPPORT_ENGINES or not shown:
        return "n/a"
    cells = ", ".join(f"{v.cell.role} {v.cell.fmt}/{v.cell.activation.value}" for v in shown)
    notes = [f"{v.cell.role}: {v.note}" for v in shown if v.note]
    return f"ok: {cells} shown for {engine} (docs/support-matrix.md)" + "".join(f"; {n}" for n in notes)


def resolve(inp: DispatchInput, shapes: Shapes | None = None) -> Resolution:
    """Apply every dispatch rule and decide the rollout's quantization.

    Precedence: an engine hf_overrides `quantization_config` (null = BF16), a config_file, or
    rollout.quantization.linear/moe (at most one of these three), else the checkpoint's own
    quantization_config (top level or under text_config), else BF16. Every rule runs for every
    source and model: a release-layout model (rule 3) or a native pass-through (rule 1) only
    decides where the quantization comes from.

    Args:
        inp: the settings.
        shapes: the model's (name, shape) pairs; rules 8 and 9, and the per-tensor check of a
            compressed-tensors config, run only when given.

    Returns:
        The Resolution. Raises the rule's typed error on the first rule that rejects.
    """
    override = override_quantization_config(inp.hf_overrides, inp.hf_overrides_key)
    outcomes = [RuleOutcome(5, "QAT vs TE recipe", "ok")]
    check_qat_te_recipe(qat_enable=inp.qat_enable, te_fp8=inp.te_fp8, te_fp4=inp.te_fp4)
    src = _source(inp, override, outcomes)
    plan, as_written = _honour(inp, src, shapes, outcomes)
    served = src.served if src.layout == "native-passthrough" else plan
    quantized = plan.is_quantized or src.layout == "native-passthrough"
    check_qat_mode(served, qat_enable=inp.qat_enable, qat_mode=inp.qat_mode)
    outcomes.append(RuleOutcome(2, "QAT mode", "ok" if inp.qat_enable else "n/a"))
    check_sync_backend(quantized, backend=inp.sync_backend, wire_format=inp.wire_format)
    outcomes.append(RuleOutcome(4, "sync backend", "ok" if quantized else "n/a"))
    check_static_activations(plan)
    shown = check_cells(inp.engine, served, src.layout) if served is not None else []
    outcomes.append(RuleOutcome(6, "engine support matrix", _support_note(inp.engine, shown)))
    check_trtllm(inp.engine, quantized)
    outcomes.append(RuleOutcome(7, "TRT-LLM restrictions", "ok" if inp.engine == "trtllm" else "n/a"))
    if shapes is not None:
        outcomes.extend(check_model(inp, plan, shapes))
    else:
        outcomes.append(RuleOutcome(8, "first/last BF16 layers", "skipped: no model given"))
        outcomes.append(RuleOutcome(9, "block-divisible K", "skipped: no model given"))
    if src.layout in ("sglang-mxfp8", "native-fp8"):
        plan = attrs.evolve(plan, scale_name="weight_scale_inv")
    return Resolution(plan, src.source, src.layout, src.native, tuple(sorted(outcomes, key=lambda o: o.rule)),
                      served=served, as_written=as_written)
