"""Property: no configuration the dispatch rules reject is accepted through an early return.

Each drawn configuration is resolved. When `resolve` accepts it, every rule is run again on its
own, on the facts of the resolution (is the rollout quantized, what does it serve, for which
engine and sync settings); none may reject. The facts themselves are checked against the label
each drawn source carries (whether it quantizes the rollout), so a resolution cannot pass by
calling a quantized rollout BF16.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.profiles import ENGINES, dispatch_for, profile_for
from domain.errors import RefitError
from domain.quant import dispatch
from domain.quant.dispatch_types import DispatchContext
from domain.quant.native_config import override_quantization_config
from domain.quant.plan import QuantizationPlan
from tests.dispatching import DispatchInput, resolve
from tests.unit.test_dispatch import CT_NVFP4, DEEPSEEK_FP8, DEEPSEEK_V4, GPT_OSS

# (label, value, quantizes the rollout)
MODELS = [
    ("none", None, False),
    ("qwen3 bf16", {"model_type": "qwen3"}, False),
    ("deepseek-v3 fp8", DEEPSEEK_FP8, True),
    ("gpt-oss mxfp4", GPT_OSS, True),
    ("deepseek-v4 fp8", DEEPSEEK_V4, True),
    ("deepseek-v4 bf16", {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"]}, False),
    ("ct nvfp4 checkpoint", {"model_type": "qwen3", "quantization_config": CT_NVFP4}, True),
]
REQUESTS = [
    (None, False),  # not drawn: one source at a time
    (QuantizationPlan.from_presets(linear="FP8_BLOCK"), True),
    (QuantizationPlan.from_presets(moe="MXFP4"), True),
    (QuantizationPlan.from_presets(linear="MXFP8", moe="MXFP4"), True),
    (QuantizationPlan.from_presets(linear="MXFP8", moe="MXFP8"), True),
    (QuantizationPlan.from_presets(moe="NVFP4"), True),
]
OVERRIDES = [(None, False), ({"quantization_config": None}, False), ({"quantization_config": CT_NVFP4}, True)]
QAT_MODES = [None, "FP8_BLOCK", "fp8", "mxfp8", "mxfp4", "mxfp4_mxfp8", "nvfp4", "w4a16"]


@st.composite
def configurations(draw: st.DrawFn) -> tuple[DispatchInput, bool]:
    _, model, model_q = draw(st.sampled_from(MODELS))
    # One source at a time besides the checkpoint (two at once is its own, separate rejection).
    kind = draw(st.sampled_from(["checkpoint", "linear/moe", "hf_overrides", "config_file"]))
    requested, requested_q = draw(st.sampled_from(REQUESTS[1:])) if kind == "linear/moe" else (None, False)
    override, override_q = draw(st.sampled_from(OVERRIDES[1:])) if kind == "hf_overrides" else (None, False)
    inp = DispatchInput(
        engine=draw(st.sampled_from(ENGINES)),
        requested=requested,
        config_file=CT_NVFP4 if kind == "config_file" else None,
        hf_overrides=override,
        model_config=model,
        qat_enable=draw(st.booleans()),
        qat_mode=draw(st.sampled_from(QAT_MODES)),
        te_fp8=draw(st.sampled_from([None, "e4m3"])),
        sync_backend=draw(st.sampled_from([None, "naive", "nccl", "delta_sharded"])),
        wire_format=draw(st.sampled_from([None, "bucketed", "delta_flush"])),
        purpose=draw(st.sampled_from(dispatch.PURPOSES)),
    )
    # The label of the source that decides (hf_overrides > config_file > linear/moe > checkpoint).
    expected = {"checkpoint": model_q, "linear/moe": requested_q, "hf_overrides": override_q,
                "config_file": True}[kind]
    return inp, bool(expected)


def _rules_accept(inp: DispatchInput, res: dispatch.Resolution) -> None:
    """Every rule, run on its own on the resolution's facts; raises when one rejects."""
    dispatch.check_qat_te_recipe(qat_enable=inp.qat_enable, te_fp8=inp.te_fp8, te_fp4=inp.te_fp4)
    dispatch.check_release_layout(inp, override_quantization_config(inp.hf_overrides, inp.hf_overrides_key))
    if inp.purpose == "refit" and res.native is not None and not res.native.exportable:
        dispatch.check_native_refit(res.native, purpose=inp.purpose)
    dispatch.check_qat_mode(res.served, qat_enable=inp.qat_enable, qat_mode=inp.qat_mode)
    dispatch.check_sync_backend(res.is_quantized, backend=inp.sync_backend, wire_format=inp.wire_format)
    if res.served is not None:
        profile_for(inp.engine).check_plan(res.served)
    engine = dispatch_for(inp.engine)
    ctx = DispatchContext(inp, engine, plan=res.plan, served=res.served, layout=res.layout, quantized=res.is_quantized)
    for rule in engine.rules:
        if rule.applies(ctx):
            rule.check(ctx)
    dispatch.check_static_activations(res.plan)


@settings(max_examples=600, deadline=None)
@given(configurations())
def test_no_early_return_accepts_what_a_rule_rejects(case: tuple[DispatchInput, bool]) -> None:
    inp, expected_quantized = case
    try:
        res = resolve(inp)
    except RefitError:
        return  # rejected: the property is about what is accepted
    _rules_accept(inp, res)  # raises if a rule would have rejected what resolve accepted
    assert res.is_quantized == expected_quantized, (res.source, res.layout)


@pytest.mark.parametrize("model", [DEEPSEEK_V4, DEEPSEEK_FP8])
def test_the_property_catches_the_release_layout_delta_sync_case(model: dict) -> None:
    # The case an early return for release layouts let through: natively FP8 + delta_sharded.
    with pytest.raises(RefitError, match="dispatch rule QuantizedFullSync"):
        resolve(DispatchInput(model_config=model, sync_backend="delta_sharded"))
