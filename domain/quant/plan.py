"""The rollout quantization plan: per tensor, BF16 or which preset, and the fused group.

A plan is a value: the preset for dense Linear layers (`linear`), for routed experts (`moe`),
the experts' activation scheme, the user's ignore entries (added to naming.DEFAULT_IGNORE), the
element rule (`numerics`) and the MX scale rule. `decide(name, shape)` is a pure function of those
and the tensor's name and shape.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from domain.errors import ConfigError
from domain.keys import key as config_key
from domain.quant import naming
from domain.quant.formats import (
    BF16,
    FP8_BLOCK,
    MXFP4,
    MXFP8,
    NVFP4,
    ActivationScheme,
    ElementRule,
    MxScaleRule,
    PrecisionFormat,
    format_by_name,
)

# Activation schemes each weight preset can run with; the first is the preset's default.
# NONE is weight-only (W4A16 / W8A16 kernels); NVFP4_STATIC needs calibrated input scales.
ACTIVATIONS: dict[str, tuple[ActivationScheme, ...]] = {
    FP8_BLOCK.name: (ActivationScheme.FP8_GROUP_128, ActivationScheme.NONE),
    MXFP8.name: (ActivationScheme.MXFP8, ActivationScheme.NONE),
    MXFP4.name: (ActivationScheme.MXFP4, ActivationScheme.MXFP8, ActivationScheme.NONE),
    NVFP4.name: (ActivationScheme.NVFP4_PER_TOKEN, ActivationScheme.NVFP4_STATIC, ActivationScheme.NONE),
}
SCALE_NAMES = ("weight_scale", "weight_scale_inv")


@attrs.frozen
class TensorDecision:
    """What the plan does with one tensor.

    Attributes:
        name: Hugging Face tensor name, e.g. `model.layers.0.self_attn.q_proj.weight`.
        format: the preset it is exported in; BF16 when it is not quantized.
        kind: "dense" | "expert" | "passthrough".
        group: the fused group sharing one NVFP4 global scale (q/k/v; gate/up, per expert),
            e.g. `model.layers.0.self_attn.qkv`; None otherwise (and for every non-NVFP4 format).
        reason: why, in words (shown by `refit plan`).
    """

    name: str
    format: PrecisionFormat
    kind: str = attrs.field(validator=attrs.validators.in_(("dense", "expert", "passthrough")))
    group: str | None
    reason: str

    @property
    def is_quantized(self) -> bool:
        return self.format.is_quantized


def _to_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.frozen
class TargetGroup:
    """One config group of a compressed-tensors quantization_config, honoured as written.

    Attributes:
        name: the group's key (`group_0`).
        targets: its targets: `Linear` (every Linear layer), exact layer names, `re:` patterns.
        format: the preset its weights are.
        activation: its activation scheme.
    """

    name: str
    targets: tuple[str, ...] = attrs.field(converter=_to_tuple)
    format: PrecisionFormat
    activation: ActivationScheme


def _to_groups(value: Iterable[TargetGroup]) -> tuple[TargetGroup, ...]:
    return tuple(value)


def target_group(groups: Iterable[TargetGroup], kind: str, module: str) -> TargetGroup | None:
    """The config group an engine gives a Linear module: a layer-name or `re:` target first (in
    the config's order), then the class target `Linear`; ignore lists are applied before.

    Args:
        groups: the config groups.
        kind: the module's naming.classify kind ("dense" or "expert").
        module: the module name (experts also match by their fused layer, `...mlp.experts`).

    Returns:
        The group, or None when no group targets the module.
    """
    groups = tuple(groups)
    names = [module]
    if kind == "expert" and (layer := naming.experts_layer(module)) is not None:
        names.append(layer)
    for g in groups:
        if any(not naming.is_class_target(t) and naming.target_matches(t, n) for t in g.targets for n in names):
            return g
    return next((g for g in groups if "Linear" in g.targets), None)


def _check_ignore(instance: object, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    for entry in value:
        problem = naming.validate_ignore_entry(entry)
        if problem:
            raise ConfigError(config_key('quantization', 'ignore'), f"{problem} (entry {entry!r})")


def _check_activation(plan: QuantizationPlan, attribute: attrs.Attribute, value: object) -> None:
    if value is None:
        return
    role = attribute.name.removesuffix("_activation")
    fmt: PrecisionFormat = getattr(plan, role)
    key = config_key("quantization", attribute.name)
    if not isinstance(value, ActivationScheme):
        raise ConfigError(key, f"expected an activation scheme, got {value!r}")
    if not fmt.is_quantized:
        raise ConfigError(key, f"{value.value!r} is set but {config_key('quantization', role)} is null; set {role} or drop it")
    allowed = ACTIVATIONS[fmt.name]
    if value not in allowed:
        raise ConfigError(
            key, f"{value.value!r} does not go with {role}={fmt.name}; valid: {', '.join(a.value for a in allowed)}"
        )


def parse_activation(
    value: str | ActivationScheme | None, key: str = config_key("quantization", "moe_activation")
) -> ActivationScheme | None:
    """Read an activation scheme by its value (`nvfp4_per_token`), case-insensitively.

    Args:
        value: the scheme, its string value, or None.
        key: the configuration key (for the error message).

    Returns:
        The ActivationScheme, or None.
    """
    if value is None or isinstance(value, ActivationScheme):
        return value
    text = str(value).strip().lower()
    for scheme in ActivationScheme:
        if text in (scheme.value, scheme.name.lower()):
            return scheme
    valid = ", ".join(s.value for s in ActivationScheme)
    raise ConfigError(key, f"unknown scheme {value!r}; valid: {valid}")


def parse_scale_rule(value: str | MxScaleRule | None) -> MxScaleRule | None:
    """Read an MX scale rule (`rceil` or `even`); None leaves it to the element rule.

    Args:
        value: the rule, its string value, or None.

    Returns:
        The MxScaleRule, or None.
    """
    if value is None or isinstance(value, MxScaleRule):
        return value
    try:
        return MxScaleRule(str(value).strip().lower())
    except ValueError:
        valid = ", ".join(r.value for r in MxScaleRule)
        raise ConfigError(config_key('quantization', 'scale_rule'), f"unknown rule {value!r}; valid: {valid} "
                          "(or null for the element rule's choice)") from None


def parse_numerics(value: str | ElementRule) -> ElementRule:
    """Read an element rule (`engine` or `compressed-tensors`; `compressed_tensors` is accepted).

    Args:
        value: the rule or its string value.

    Returns:
        The ElementRule.
    """
    if isinstance(value, ElementRule):
        return value
    try:
        return ElementRule(str(value).strip().lower().replace("_", "-"))
    except ValueError:
        valid = ", ".join(r.value for r in ElementRule)
        raise ConfigError(config_key('quantization', 'numerics'), f"unknown element rule {value!r}; valid: {valid}") from None


def parse_format(key: str, value: str | PrecisionFormat | None) -> PrecisionFormat:
    """Read a preset name for configuration key `key`; None means BF16.

    Args:
        key: the configuration key (for the error message).
        value: a preset name, a PrecisionFormat, or None.

    Returns:
        The PrecisionFormat.
    """
    if isinstance(value, PrecisionFormat):
        return value
    try:
        return format_by_name(value)
    except KeyError as err:
        raise ConfigError(key, str(err.args[0])) from None


@attrs.frozen
class QuantizationPlan:
    """A rollout quantization: presets for dense and expert Linear weights, and what stays BF16.

    Attributes:
        linear: preset for dense Linear layers (BF16 = not quantized).
        moe: preset for routed experts (BF16 = not quantized).
        moe_activation: the experts' activation scheme; None = the moe preset's default.
        ignore: the user's ignore entries, added to naming.DEFAULT_IGNORE.
        scale_rule: the MX shared-exponent rule the user chose (it wins for both MX formats); None =
            each format's rule under `numerics` (`PrecisionFormat.scale_rule`).
        scale_name: checkpoint name of the block scale: `weight_scale` (compressed-tensors) or
            `weight_scale_inv` (native DeepSeek-style FP8 and SGLang's native MXFP8).
        linear_activation: the dense layers' activation scheme; None = the linear preset's default.
        targets: the config groups of a user's compressed-tensors config, when its targets cover
            only some Linear layers (empty: every dense / expert Linear weight is quantized).
        numerics: the element rule: ENGINE (the engine's own quantizers, default) or
            COMPRESSED_TENSORS (llm-compressor checkpoints byte for byte).
        expert_layout: the names NVFP4 expert tensors take: "compressed-tensors" (default) or
            "modelopt" (`weight`, `weight_scale`, `weight_scale_2`: domain.quant.modelopt_layout),
            the layout vLLM serves per-token NVFP4 experts in.
    """

    linear: PrecisionFormat = BF16
    moe: PrecisionFormat = BF16
    moe_activation: ActivationScheme | None = attrs.field(default=None, validator=_check_activation)
    ignore: tuple[str, ...] = attrs.field(default=(), converter=_to_tuple, validator=_check_ignore)
    scale_rule: MxScaleRule | None = None
    scale_name: str = attrs.field(default="weight_scale", validator=attrs.validators.in_(SCALE_NAMES))
    linear_activation: ActivationScheme | None = attrs.field(default=None, validator=_check_activation)
    targets: tuple[TargetGroup, ...] = attrs.field(default=(), converter=_to_groups)
    numerics: ElementRule = ElementRule.ENGINE
    expert_layout: str = attrs.field(default="compressed-tensors",
                                     validator=attrs.validators.in_(("compressed-tensors", "modelopt")))

    @classmethod
    def bf16(cls) -> QuantizationPlan:
        """The plan that quantizes nothing."""
        return cls()

    @classmethod
    def from_presets(
        cls,
        linear: str | PrecisionFormat | None = None,
        moe: str | PrecisionFormat | None = None,
        ignore: Iterable[str] = (),
        moe_activation: str | ActivationScheme | None = None,
        scale_rule: str | MxScaleRule | None = None,
        scale_name: str = "weight_scale",
        linear_activation: str | ActivationScheme | None = None,
        numerics: str | ElementRule = ElementRule.ENGINE,
    ) -> QuantizationPlan:
        """Build a plan from preset names, as the configuration writes them.

        Args:
            linear: preset for dense Linear layers (e.g. "FP8_BLOCK"), or None for BF16.
            moe: preset for routed experts, or None for BF16.
            ignore: user ignore entries (exact names, dot suffixes, `re:` regexes, fnmatch).
            moe_activation: e.g. "nvfp4_per_token" or "mxfp8"; None = the moe preset's default.
            scale_rule: "rceil" or "even" for both MX formats; None (default) = each format's rule
                under `numerics`.
            scale_name: "weight_scale" or "weight_scale_inv".
            linear_activation: like moe_activation, for dense layers.
            numerics: "engine" (default) or "compressed-tensors".

        Returns:
            The validated plan. Raises ConfigError naming the key on a bad value.
        """
        return cls(
            linear=parse_format(config_key("quantization", "linear"), linear),
            moe=parse_format(config_key("quantization", "moe"), moe),
            moe_activation=parse_activation(moe_activation, config_key("quantization", "moe_activation")),
            linear_activation=parse_activation(linear_activation, config_key("quantization", "linear_activation")),
            ignore=tuple(ignore),
            scale_rule=parse_scale_rule(scale_rule),
            scale_name=scale_name,
            numerics=parse_numerics(numerics),
        )

    @property
    def is_quantized(self) -> bool:
        """True when dense or expert weights are quantized."""
        return self.linear.is_quantized or self.moe.is_quantized

    @property
    def effective_moe_activation(self) -> ActivationScheme:
        """The experts' activation scheme, defaults applied (NONE when experts stay BF16)."""
        return self.moe.activation if self.moe_activation is None else self.moe_activation

    @property
    def effective_linear_activation(self) -> ActivationScheme:
        """The dense layers' activation scheme, defaults applied (NONE when they stay BF16)."""
        return self.linear.activation if self.linear_activation is None else self.linear_activation

    def scale_rule_for(self, fmt: PrecisionFormat) -> MxScaleRule | None:
        """The MX exponent rule `fmt` is quantized with under this plan (None for non-MX formats)."""
        return fmt.scale_rule(self.numerics, self.scale_rule)

    @property
    def formats(self) -> tuple[PrecisionFormat, ...]:
        """The distinct quantized presets the plan uses."""
        return tuple(dict.fromkeys(f for f in (self.linear, self.moe) if f.is_quantized))

    def decide(self, name: str, shape: tuple[int, ...]) -> TensorDecision:
        """Decide one tensor.

        Args:
            name: Hugging Face tensor name.
            shape: its shape.

        Returns:
            The TensorDecision (format, kind, fused group, reason).
        """
        cls = naming.classify(name, tuple(shape))
        if cls.kind == "passthrough":
            return TensorDecision(name, BF16, "passthrough", None, cls.reason)
        key = "linear" if cls.kind == "dense" else "moe"
        fmt = self.linear if cls.kind == "dense" else self.moe
        if not fmt.is_quantized:
            return TensorDecision(name, BF16, cls.kind, None, f"{cls.reason}; {config_key('quantization', key)} is null")
        entry = naming.first_match(self.ignore, name)
        if entry is not None:
            return TensorDecision(name, BF16, cls.kind, None, f"{cls.reason}; ignored by '{entry}'")
        if self.targets and target_group(self.targets, cls.kind, cls.module) is None:
            return TensorDecision(name, BF16, cls.kind, None, f"{cls.reason}; no config group targets it")
        group = cls.group if fmt is NVFP4 or fmt.name == NVFP4.name else None
        if cls.fused_experts:
            group = None  # one tensor: its per-expert global scales are computed from it alone
        return TensorDecision(name, fmt, cls.kind, group, f"{cls.reason}; {config_key('quantization', key)} = {fmt.name}")
