"""Which rule each format of a plan is quantized with, and why: what `refit plan` prints and the
exported checkpoint records.

A plan's element rule (`numerics`) applies to every format it uses, for weights and for the
activations the rollout quantizes alike; the MX exponent rule is the user's
`rollout.quantization.scale_rule` when set, else the format's own rule under the element rule.
"""

from __future__ import annotations

from typing import Any

import attrs

from domain.keys import key
from domain.quant.formats import (
    FP8_BLOCK,
    MXFP4,
    MXFP8,
    NVFP4,
    ActivationScheme,
    ElementRule,
    MxScaleRule,
    PrecisionFormat,
    RuleSpec,
)
from domain.quant.plan import QuantizationPlan

# The format whose codec quantizes each activation scheme.
ACTIVATION_FORMATS: dict[ActivationScheme, PrecisionFormat] = {
    ActivationScheme.FP8_GROUP_128: FP8_BLOCK,
    ActivationScheme.MXFP8: MXFP8,
    ActivationScheme.MXFP4: MXFP4,
    ActivationScheme.NVFP4_PER_TOKEN: NVFP4,
    ActivationScheme.NVFP4_STATIC: NVFP4,
}

_WHY = {
    ElementRule.ENGINE: f"{key('quantization', 'numerics')} = engine: the operation order of the engine's own "
                        "quantizer and of the QAT kernels",
    ElementRule.COMPRESSED_TENSORS: f"{key('quantization', 'numerics')} = compressed-tensors: byte-compatible with "
                                    "llm-compressor checkpoints",
}


@attrs.frozen
class NumericsDecision:
    """The rules one format of a plan is quantized with.

    Attributes:
        format: the format.
        roles: what it quantizes: "weights", "activations" or both.
        element_rule: the plan's element rule.
        scale_rule: MX only: the exponent rule.
        spec: the element rule's formula and reference for this format.
        element_reason: why this element rule, in words.
        scale_reason: MX only: why this exponent rule.
    """

    format: PrecisionFormat
    roles: tuple[str, ...]
    element_rule: ElementRule
    scale_rule: MxScaleRule | None
    spec: RuleSpec
    element_reason: str
    scale_reason: str | None = None

    @property
    def reason(self) -> str:
        return self.element_reason if self.scale_reason is None else f"{self.element_reason}; {self.scale_reason}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format.name,
            "roles": list(self.roles),
            "element_rule": self.element_rule.value,
            "scale_rule": None if self.scale_rule is None else self.scale_rule.value,
            "formula": self.spec.formula,
            "reference": self.spec.reference,
            "reason": self.reason,
        }


def _scale_reason(plan: QuantizationPlan, fmt: PrecisionFormat, rule: MxScaleRule) -> str:
    if plan.scale_rule is not None:
        return f"set by {key('quantization', 'scale_rule')}"
    if plan.numerics is ElementRule.ENGINE:
        return f"the rule of {fmt.name}'s engine quantizer"
    return "compressed-tensors' rule"


def numerics_decisions(plan: QuantizationPlan) -> tuple[NumericsDecision, ...]:
    """One decision per format the plan quantizes weights or activations with, weights first.

    Args:
        plan: the plan.

    Returns:
        The decisions (empty for a BF16 plan).
    """
    roles: dict[str, tuple[PrecisionFormat, list[str]]] = {}
    for fmt in plan.formats:
        roles.setdefault(fmt.name, (fmt, []))[1].append("weights")
    for fmt, scheme in ((plan.linear, plan.effective_linear_activation), (plan.moe, plan.effective_moe_activation)):
        act = ACTIVATION_FORMATS.get(scheme) if fmt.is_quantized else None
        if act is not None and "activations" not in roles.setdefault(act.name, (act, []))[1]:
            roles[act.name][1].append("activations")
    out = []
    for fmt, used in roles.values():
        spec = fmt.rule_spec(plan.numerics)
        if spec is None:
            continue
        rule = plan.scale_rule_for(fmt)
        scale_reason = None if rule is None else _scale_reason(plan, fmt, rule)
        out.append(NumericsDecision(fmt, tuple(used), plan.numerics, rule, spec, _WHY[plan.numerics], scale_reason))
    return tuple(out)


def numerics_metadata(plan: QuantizationPlan) -> dict[str, Any]:
    """The rules as the exported checkpoint records them (a key loaders ignore).

    Args:
        plan: a quantized plan.

    Returns:
        {"element_rule": ..., "formats": {name: {"element_rule", "scale_rule" (MX), "reference"}}}.
    """
    formats: dict[str, Any] = {}
    for d in numerics_decisions(plan):
        entry: dict[str, Any] = {"element_rule": d.element_rule.value, "reference": d.spec.reference}
        if d.scale_rule is not None:
            entry["scale_rule"] = d.scale_rule.value
        formats[d.format.name] = entry
    return {"element_rule": plan.numerics.value, "formats": formats}
