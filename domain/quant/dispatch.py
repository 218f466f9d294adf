"""Dispatch rules (ARCHITECTURE.md section 4): each a pure function raising a typed error.

`resolve` applies them in order to one DispatchInput and returns the Resolution: the plan the
trainer exports, where it came from, the checkpoint layout the engine gets, and every rule's
outcome in words (what `refit plan` prints).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from domain.errors import (
    EngineRejectsQuantization,
    NativeLayoutOverride,
    QatModeMismatch,
    QatWithTeRecipe,
    QuantizedDeltaSync,
    UnsupportedCombination,
    UnsupportedQuantMethod,
)
from domain.quant import naming
from domain.quant.formats import MXFP4, MXFP8, NVFP4, ActivationScheme, format_by_name
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

ENGINES = ("vllm", "sglang", "trtllm", "reference")
DELTA_BACKENDS = ("delta_sharded",)
DELTA_WIRE_FORMATS = ("delta_flush",)
# Models whose own exporter emits the release quantized layout (rule 3).
RELEASE_LAYOUT_MODEL_TYPES = ("deepseek_v4",)
RELEASE_LAYOUT_ARCHITECTURES = ("DeepseekV4ForCausalLM",)


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
    """

    engine: str = attrs.field(default="reference", validator=attrs.validators.in_(ENGINES))
    requested: QuantizationPlan | None = None
    ignore: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    config_file: Mapping[str, Any] | None = None
    hf_overrides: Mapping[str, Any] | str | None = None
    hf_overrides_key: str = "rollout.engine_kwargs.vllm.hf_overrides"
    model_config: Mapping[str, Any] | None = None
    qat_enable: bool = False
    qat_mode: str | None = None
    qat_ignore: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    te_fp8: object = None
    te_fp4: object = None
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    sync_backend: str | None = None
    wire_format: str | None = None


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
        native: the quantization_config passed to the engine unchanged (native layouts), or None.
        outcomes: each rule's verdict, in order.
    """

    plan: QuantizationPlan
    source: str
    layout: str
    native: NativeConfig | None
    outcomes: tuple[RuleOutcome, ...]

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


# --- rules 2, 4, 5, 6, 7 ----------------------------------------------------------------------


def check_qat_mode(plan: QuantizationPlan, *, qat_enable: bool, qat_mode: str | None) -> None:
    """Rule 2: QAT fake-quantizes to the format the rollout serves.

    Args:
        plan: the resolved rollout plan.
        qat_enable: actor.megatron.qat.enable.
        qat_mode: actor.megatron.qat.mode (a preset name).

    Returns:
        None. Raises QatModeMismatch naming both settings.
    """
    if not qat_enable:
        return
    mode = format_by_name(qat_mode).name if qat_mode else None
    rollout = [f.name for f in plan.formats]
    if mode is None or rollout != [mode]:
        raise QatModeMismatch(
            f"actor.megatron.qat.mode={qat_mode!r} does not match the rollout quantization "
            f"(rollout.quantization: {', '.join(rollout) or 'BF16'}); QAT must train in the one format "
            f"the rollout serves: set qat.mode to {rollout[0] if len(rollout) == 1 else 'that format'}, or "
            "change rollout.quantization, or disable QAT"
        )


def check_sync_backend(quantized: bool, *, backend: str | None, wire_format: str | None) -> None:
    """Rule 4: a quantized rollout needs the complete bucket sequence to finalize.

    Args:
        quantized: whether the rollout is quantized.
        backend: rollout.checkpoint_engine.backend.
        wire_format: rollout.wire_format.

    Returns:
        None. Raises QuantizedDeltaSync naming the key.
    """
    if not quantized:
        return
    if backend in DELTA_BACKENDS:
        raise QuantizedDeltaSync(
            f"rollout.checkpoint_engine.backend={backend!r} sends partial updates, but a quantized rollout "
            "post-processes once after the complete bucket sequence; use a full-sync backend (e.g. 'nccl')"
        )
    if wire_format in DELTA_WIRE_FORMATS:
        raise QuantizedDeltaSync(
            f"rollout.wire_format={wire_format!r} flushes deltas, but a quantized rollout needs every bucket "
            "before finalizing; use the 'bucketed' wire format"
        )


def check_qat_te_recipe(*, qat_enable: bool, te_fp8: object, te_fp4: object) -> None:
    """Rule 5: QAT and a Transformer Engine FP8/FP4 training recipe are mutually exclusive.

    Args:
        qat_enable: actor.megatron.qat.enable.
        te_fp8: override_transformer_config.fp8 (None/False = off).
        te_fp4: override_transformer_config.fp4 (None/False = off).

    Returns:
        None. Raises QatWithTeRecipe naming the keys.
    """
    on = [k for k, v in (("fp8", te_fp8), ("fp4", te_fp4)) if v not in (None, False, "")]
    if qat_enable and on:
        keys = ", ".join(f"actor.megatron.override_transformer_config.{k}" for k in on)
        raise QatWithTeRecipe(
            f"actor.megatron.qat.enable is true together with {keys}: QAT fake-quantizes BF16 weights and "
            "cannot run inside a Transformer Engine low-precision recipe; disable one of them"
        )


def check_sglang(engine: str, plan: QuantizationPlan) -> None:
    """Rule 6: SGLang has no MXFP8-linear + MXFP4-MoE combination and no per-token NVFP4.

    Args:
        engine: rollout.name.
        plan: the resolved plan.

    Returns:
        None. Raises EngineRejectsQuantization.
    """
    if engine != "sglang":
        return
    if plan.linear.name == MXFP8.name and plan.moe.name == MXFP4.name:
        raise EngineRejectsQuantization(
            "rollout.name=sglang does not serve rollout.quantization.linear=MXFP8 with moe=MXFP4; "
            "use moe=MXFP8 (or linear=null), or rollout.name=vllm"
        )
    for role, fmt, act in (("linear", plan.linear, plan.effective_linear_activation),
                           ("moe", plan.moe, plan.effective_moe_activation)):
        if fmt.name == NVFP4.name and act is ActivationScheme.NVFP4_PER_TOKEN:
            raise EngineRejectsQuantization(
                f"rollout.name=sglang has no per-token NVFP4 activation path (rollout.quantization.{role}=NVFP4); "
                "use rollout.name=vllm, or another preset (MXFP4, MXFP8, FP8_BLOCK)"
            )


def check_trtllm(engine: str, quantized: bool) -> None:
    """Rule 7: TRT-LLM accepts no rollout quantization.

    Args:
        engine: rollout.name.
        quantized: whether the rollout is quantized.

    Returns:
        None. Raises EngineRejectsQuantization naming vLLM and SGLang.
    """
    if engine == "trtllm" and quantized:
        raise EngineRejectsQuantization(
            "rollout.name=trtllm accepts no rollout quantization; use rollout.name=vllm or "
            "rollout.name=sglang, or set rollout.quantization.linear and moe to null"
        )


def check_static_activations(plan: QuantizationPlan) -> None:
    """Static NVFP4 activations need calibrated input scales that a trainer cannot compute.

    Args:
        plan: the resolved plan.

    Returns:
        None. Raises UnsupportedCombination naming the key.
    """
    for role, act in (("linear", plan.effective_linear_activation), ("moe", plan.effective_moe_activation)):
        if act is ActivationScheme.NVFP4_STATIC:
            raise UnsupportedCombination(
                f"rollout.quantization.{role} uses static NVFP4 activations, which need a calibrated "
                "input_global_scale the trainer-side export cannot compute; use nvfp4_per_token "
                f"(rollout.quantization.{role}_activation) instead"
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
    if engine == "sglang" and [f.name for f in plan.formats] == [MXFP8.name]:
        return "sglang-mxfp8"
    if native is not None and native.method == "mxfp8":
        return "sglang-mxfp8"
    return "compressed-tensors"


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
        return _from_native(parse_quantization_config(override, ignore=inp.ignore), "hf_overrides", inp)
    if inp.config_file is not None:
        return _from_native(parse_quantization_config(inp.config_file, ignore=inp.ignore), "config_file", inp)
    if inp.requested is not None:
        return "rollout.quantization", _with_ignore(inp.requested, inp), None
    found = find_quantization_config(inp.model_config)
    if found is None:
        return "none", QuantizationPlan.bf16(), None
    return _from_native(parse_quantization_config(found[1], ignore=inp.ignore), "checkpoint", inp)


def _from_native(native: NativeConfig, source: str, inp: DispatchInput) -> tuple[str, QuantizationPlan, NativeConfig]:
    check_unsupported_method(native, source=source, qat_enable=inp.qat_enable)
    return source, native.plan or QuantizationPlan.bf16(), native


def resolve(inp: DispatchInput, shapes: Shapes | None = None) -> Resolution:
    """Apply every dispatch rule and decide the rollout's quantization.

    Precedence: an engine hf_overrides `quantization_config` (null = BF16), a config_file, or
    rollout.quantization.linear/moe (at most one of these three), else the checkpoint's own
    quantization_config (top level or under text_config), else BF16.

    Args:
        inp: the settings.
        shapes: the model's (name, shape) pairs; rules 8 and 9 run only when given.

    Returns:
        The Resolution. Raises the rule's typed error on the first rule that rejects.
    """
    override = override_quantization_config(inp.hf_overrides, inp.hf_overrides_key)
    outcomes = [RuleOutcome(5, "QAT vs TE recipe", "ok")]
    check_qat_te_recipe(qat_enable=inp.qat_enable, te_fp8=inp.te_fp8, te_fp4=inp.te_fp4)
    if check_release_layout(inp, override):
        release = parse_quantization_config((find_quantization_config(inp.model_config) or ("", {}))[1])
        outcomes.append(RuleOutcome(3, "release layout", "native quantization_config passes through unchanged"))
        return Resolution(QuantizationPlan.bf16(), "checkpoint", "native-passthrough", release, tuple(outcomes))
    outcomes.append(RuleOutcome(3, "release layout", "n/a"))
    source, plan, native = _select(inp, override)
    if native is not None and not native.exportable:
        outcomes.append(RuleOutcome(1, "unsupported native method", f"{native.method!r} passes through untouched"))
        layout = "native-passthrough"
    else:
        outcomes.append(RuleOutcome(1, "unsupported native method", "n/a"))
        layout = layout_for(inp.engine, plan, native)
    quantized = plan.is_quantized or layout == "native-passthrough"
    check_qat_mode(plan, qat_enable=inp.qat_enable, qat_mode=inp.qat_mode)
    outcomes.append(RuleOutcome(2, "QAT mode", "ok" if inp.qat_enable else "n/a"))
    check_sync_backend(quantized, backend=inp.sync_backend, wire_format=inp.wire_format)
    outcomes.append(RuleOutcome(4, "sync backend", "ok" if quantized else "n/a"))
    check_sglang(inp.engine, plan)
    outcomes.append(RuleOutcome(6, "SGLang restrictions", "ok" if inp.engine == "sglang" else "n/a"))
    check_trtllm(inp.engine, quantized)
    outcomes.append(RuleOutcome(7, "TRT-LLM restrictions", "ok" if inp.engine == "trtllm" else "n/a"))
    check_static_activations(plan)
    if shapes is not None:
        outcomes.extend(check_model(inp, plan, shapes))
    else:
        outcomes.append(RuleOutcome(8, "first/last BF16 layers", "skipped: no model given"))
        outcomes.append(RuleOutcome(9, "block-divisible K", "skipped: no model given"))
    if layout in ("sglang-mxfp8", "native-fp8"):
        plan = attrs.evolve(plan, scale_name="weight_scale_inv")
    return Resolution(plan, source, layout, native, tuple(sorted(outcomes, key=lambda o: o.rule)))
