"""QuantizationPlan: construction from presets, validation errors, per-tensor decisions."""

from __future__ import annotations

import attrs
import pytest

from domain.errors import ConfigError
from domain.quant.formats import (
    BF16,
    FP8_BLOCK,
    MXFP4,
    MXFP8,
    NVFP4,
    ActivationScheme,
    ElementRule,
    MxScaleRule,
)
from domain.quant.numerics import numerics_decisions, numerics_metadata
from domain.quant.plan import QuantizationPlan, TensorDecision


def test_from_presets_reads_names_case_insensitively() -> None:
    plan = QuantizationPlan.from_presets(linear="fp8-block", moe="nvfp4", ignore=["lm_head"], scale_rule="even")
    assert (plan.linear, plan.moe, plan.ignore, plan.scale_rule) == (FP8_BLOCK, NVFP4, ("lm_head",), MxScaleRule.EVEN)
    assert plan.is_quantized
    assert plan.formats == (FP8_BLOCK, NVFP4)
    assert plan.effective_moe_activation is ActivationScheme.NVFP4_PER_TOKEN
    assert plan.effective_linear_activation is ActivationScheme.FP8_GROUP_128


def test_bf16_plan_quantizes_nothing() -> None:
    plan = QuantizationPlan.bf16()
    assert not plan.is_quantized and plan.formats == ()
    d = plan.decide("model.layers.0.self_attn.q_proj.weight", (64, 64))
    assert d.format is BF16 and d.kind == "dense" and "rollout.quantization.linear is null" in d.reason


@pytest.mark.parametrize(("kwargs", "key", "text"), [
    ({"linear": "FP9"}, "rollout.quantization.linear", "valid: BF16, FP8_BLOCK"),
    ({"moe": "int4"}, "rollout.quantization.moe", "unknown precision format"),
    ({"moe": "NVFP4", "moe_activation": "fp16"}, "rollout.quantization.moe_activation", "unknown scheme"),
    ({"moe_activation": "mxfp8"}, "rollout.quantization.moe_activation", "moe is null"),
    ({"moe": "NVFP4", "moe_activation": "mxfp8"}, "rollout.quantization.moe_activation", "does not go with moe=NVFP4"),
    ({"linear": "FP8_BLOCK", "linear_activation": "mxfp4"}, "rollout.quantization.linear_activation", "linear=FP8_BLOCK"),
    ({"linear": "MXFP8", "ignore": ["re:("]}, "rollout.quantization.ignore", "invalid regular expression"),
    ({"linear": "MXFP8", "scale_rule": "floor"}, "rollout.quantization.scale_rule", "valid: rceil, even"),
    ({"linear": "MXFP8", "numerics": "llm"}, "rollout.quantization.numerics", "valid: engine, compressed-tensors"),
])
def test_bad_values_name_the_key(kwargs: dict, key: str, text: str) -> None:
    with pytest.raises(ConfigError, match=text) as err:
        QuantizationPlan.from_presets(**kwargs)
    assert err.value.key == key


def test_w4a8_moe_activation_is_accepted() -> None:
    plan = QuantizationPlan.from_presets(moe="MXFP4", moe_activation="mxfp8")
    assert plan.effective_moe_activation is ActivationScheme.MXFP8
    assert plan.effective_linear_activation is ActivationScheme.NONE


def test_decisions_dense_expert_passthrough_and_groups() -> None:
    plan = QuantizationPlan.from_presets(linear="NVFP4", moe="MXFP4")
    q = plan.decide("model.layers.0.self_attn.q_proj.weight", (64, 64))
    assert q == TensorDecision("model.layers.0.self_attn.q_proj.weight", NVFP4, "dense",
                               "model.layers.0.self_attn.qkv", q.reason)
    assert "rollout.quantization.linear = NVFP4" in q.reason
    o = plan.decide("model.layers.0.self_attn.o_proj.weight", (64, 64))
    assert o.format is NVFP4 and o.group is None
    e = plan.decide("model.layers.0.mlp.experts.1.gate_proj.weight", (32, 64))
    assert (e.format, e.kind, e.group) == (MXFP4, "expert", None)  # MX formats have no global scale
    fused = plan.decide("model.layers.0.mlp.experts.gate_up_proj", (4, 64, 64))
    assert (fused.format, fused.kind, fused.group) == (MXFP4, "expert", None)
    router = plan.decide("model.layers.0.mlp.gate.weight", (4, 64))
    assert (router.format, router.kind) == (BF16, "passthrough")
    norm = plan.decide("model.norm.weight", (64,))
    assert (norm.format, norm.kind) == (BF16, "passthrough")


def test_nvfp4_experts_share_a_group_per_expert() -> None:
    plan = QuantizationPlan.from_presets(moe="NVFP4")
    up = plan.decide("model.layers.3.mlp.experts.7.up_proj.weight", (32, 64))
    assert up.group == "model.layers.3.mlp.experts.7.gate_up"
    assert plan.decide("model.layers.3.mlp.experts.gate_up_proj", (4, 64, 64)).group is None


def test_user_ignore_keeps_bf16_and_says_which_entry() -> None:
    plan = QuantizationPlan.from_presets(linear="MXFP8", ignore=["re:.*layers\\.0\\..*", "o_proj"])
    d = plan.decide("model.layers.0.self_attn.q_proj.weight", (64, 64))
    assert d.format is BF16 and d.kind == "dense" and "re:.*layers\\.0\\..*" in d.reason
    assert plan.decide("model.layers.1.self_attn.o_proj.weight", (64, 64)).format is BF16
    assert plan.decide("model.layers.1.self_attn.q_proj.weight", (64, 64)).format is MXFP8


def test_plan_is_frozen_and_scale_name_validated() -> None:
    plan = QuantizationPlan.from_presets(linear="FP8_BLOCK")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        plan.linear = MXFP8  # type: ignore[misc]
    assert attrs.evolve(plan, scale_name="weight_scale_inv").scale_name == "weight_scale_inv"
    with pytest.raises(ValueError):
        attrs.evolve(plan, scale_name="scale")


def test_numerics_default_to_the_engine_and_scale_rules_to_each_format() -> None:
    plan = QuantizationPlan.from_presets("MXFP8", "MXFP4")
    assert plan.numerics is ElementRule.ENGINE and plan.scale_rule is None
    assert (plan.scale_rule_for(MXFP8), plan.scale_rule_for(MXFP4)) == (MxScaleRule.RCEIL, MxScaleRule.EVEN)
    ct = QuantizationPlan.from_presets("MXFP8", "MXFP4", numerics="compressed_tensors")
    assert ct.numerics is ElementRule.COMPRESSED_TENSORS
    assert (ct.scale_rule_for(MXFP8), ct.scale_rule_for(MXFP4)) == (MxScaleRule.EVEN, MxScaleRule.EVEN)
    chosen = QuantizationPlan.from_presets("MXFP8", "MXFP4", numerics="compressed-tensors", scale_rule="rceil")
    assert (chosen.scale_rule_for(MXFP8), chosen.scale_rule_for(MXFP4)) == (MxScaleRule.RCEIL, MxScaleRule.RCEIL)
    assert chosen.scale_rule_for(FP8_BLOCK) is None


def test_numerics_decisions_cover_weight_and_activation_formats() -> None:
    plan = QuantizationPlan.from_presets("NVFP4", "MXFP4", moe_activation="mxfp8")
    decisions = {d.format.name: d for d in numerics_decisions(plan)}
    assert list(decisions) == ["NVFP4", "MXFP4", "MXFP8"]
    assert decisions["NVFP4"].roles == ("weights", "activations") and decisions["NVFP4"].scale_rule is None
    assert decisions["MXFP4"].roles == ("weights",) and decisions["MXFP8"].roles == ("activations",)
    assert "ref_nvfp4_quant" in decisions["NVFP4"].spec.reference
    assert decisions["MXFP4"].scale_reason == "the rule of MXFP4's engine quantizer"
    assert numerics_metadata(plan) == {"element_rule": "engine", "formats": {
        "NVFP4": {"element_rule": "engine", "reference": NVFP4.rule_spec(ElementRule.ENGINE).reference},
        "MXFP4": {"element_rule": "engine", "scale_rule": "even", "reference": MXFP4.rule_spec(ElementRule.ENGINE).reference},
        "MXFP8": {"element_rule": "engine", "scale_rule": "rceil", "reference": MXFP8.rule_spec(ElementRule.ENGINE).reference},
    }}
    assert numerics_decisions(QuantizationPlan.bf16()) == ()
