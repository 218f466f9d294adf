"""The values the dispatch rules work on: their input, one engine's part in them, the rule
objects, and what they decide (docs/plan.md#the-dispatch-rules).

domain.quant.dispatch holds the ordered list of rules and applies it. An engine adds to it only
through an EngineDispatch, built by its adapter's profile (adapters/<engine>/profile.py): the
layout it reads a plan in, its support table (EngineSupportMatrix) and the rules only it has.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import attrs

from domain.keys import key
from domain.quant.model_rules import Shapes
from domain.quant.native_config import NativeConfig
from domain.quant.plan import QuantizationPlan
from domain.quant.support import COMPRESSED_TENSORS, NATIVE_FP8, NATIVE_PASSTHROUGH, SupportTable

# What the resolution is for: a refit (the trainer's tensors reach a live engine) or `refit
# export` (a checkpoint on disk; a native layout the trainer cannot produce is copied as it is).
PURPOSES = ("refit", "export")


def _overrides_key(inp: DispatchInput) -> str:
    return key("engine_kwargs", inp.engine, "hf_overrides")


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
        hf_overrides_key: its configuration key, for messages (by default the engine's
            `rollout.engine_kwargs.<engine>.hf_overrides`).
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

    engine: str = attrs.field(default="reference", validator=attrs.validators.min_len(1))
    requested: QuantizationPlan | None = None
    ignore: tuple[str, ...] = attrs.field(default=(), converter=_names)
    config_file: Mapping[str, Any] | None = None
    hf_overrides: Mapping[str, Any] | str | None = None
    hf_overrides_key: str = attrs.field(default=attrs.Factory(_overrides_key, takes_self=True))
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
class DispatchContext:
    """What a rule looks at: the settings, the engine, and what the resolution decided.

    Attributes:
        inp: the settings.
        engine: the engine's part in the rules.
        shapes: the model's (name, shape) pairs, or None when no model is given.
        plan: the plan the trainer exports.
        served: what the engine serves (None: a native layout no preset describes).
        layout: the checkpoint layout the engine reads.
        quantized: whether the rollout serves quantized weights (trainer-made or native).
    """

    inp: DispatchInput
    engine: EngineDispatch
    shapes: Shapes | None = None
    plan: QuantizationPlan = attrs.field(factory=QuantizationPlan.bf16)
    served: QuantizationPlan | None = None
    layout: str = "bf16"
    quantized: bool = False


def _ok(ctx: DispatchContext) -> str:
    return "ok"


@attrs.frozen
class Rule:
    """One dispatch rule.

    Attributes:
        name: the rule's name, as `refit plan` and the rule's errors print it; docs/plan.md has a
            section of that name (its anchor is the name in lower case).
        summary: what it checks, in a few words (`refit plan`'s "check" column).
        check: raises the rule's typed error when the context breaks it; returns None otherwise.
        outcome: the verdict in words once the check passed; None prints no line.
        engine: the only engine the rule applies to (None: every engine); for the others its
            outcome is "n/a" and the check does not run.
    """

    name: str = attrs.field(validator=attrs.validators.matches_re(r"[A-Z][A-Za-z0-9]*"))
    summary: str
    check: Callable[[DispatchContext], None]
    outcome: Callable[[DispatchContext], str | None] = _ok
    engine: str | None = None

    def applies(self, ctx: DispatchContext) -> bool:
        """Whether the rule looks at this context's engine."""
        return self.engine is None or self.engine == ctx.engine.name


@attrs.frozen
class RuleOutcome:
    """One rule's verdict: `rule` is the rule's name, `summary` what it checks."""

    rule: str
    summary: str
    outcome: str


def _layouts(value: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(value))


def _compressed_tensors(plan: QuantizationPlan) -> str:
    return COMPRESSED_TENSORS


@attrs.frozen
class EngineDispatch:
    """One engine's part in the dispatch rules, contributed by its adapter's profile.

    Attributes:
        name: rollout.name.
        native_layouts: a native quantization_config's `quant_method` -> the layout the engine
            reads it in (methods not listed are read as compressed-tensors).
        default_layout: the layout a plan from rollout.quantization reaches the engine in.
        support: the engine's support table (EngineSupportMatrix); None when it has none (every cell
            passes).
        rules: the dispatch rules the engines add, in order (run after EngineSupportMatrix).
    """

    name: str
    native_layouts: Mapping[str, str] = attrs.field(factory=lambda: {"fp8": NATIVE_FP8}, converter=_layouts)
    default_layout: Callable[[QuantizationPlan], str] = _compressed_tensors
    support: SupportTable | None = None
    rules: tuple[Rule, ...] = ()

    def layout_for(self, plan: QuantizationPlan, native: NativeConfig | None) -> str:
        """The checkpoint layout the engine reads a plan in.

        Args:
            plan: the resolved plan.
            native: the native config the plan came from, if any.

        Returns:
            "bf16", "compressed-tensors", or a native layout (NATIVE_FP8 or the engine's own).
        """
        if not plan.is_quantized:
            return "bf16"
        if native is not None and native.method in self.native_layouts:
            return self.native_layouts[native.method]
        return self.default_layout(plan)


@attrs.frozen
class Resolution:
    """What the dispatch decided.

    Attributes:
        plan: the plan the trainer exports (BF16 when nothing is quantized by the trainer).
        source: "none" | "rollout.quantization" | "config_file" | "hf_overrides" | "checkpoint".
        layout: "bf16" | "compressed-tensors" | "native-fp8" | "native-passthrough" | an engine's
            own native layout (EngineDispatch.native_layouts).
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
        return self.plan.is_quantized or self.layout == NATIVE_PASSTHROUGH
