"""The engine profiles (ports/engine_profile.py): each engine's knowledge beside its adapter, the
registry the composition root picks from, and how an engine takes part in the dispatch rules."""

from __future__ import annotations

import attrs
import pytest

from adapters.engine_profile import NATIVE_LAYOUTS, StaticEngineProfile
from adapters.profiles import DISTRIBUTIONS, ENGINES, PINNED_ENGINES, PROFILES, dispatch_for, profile_for
from adapters.sglang.profile import PINNED_SGLANG
from adapters.trtllm.profile import BF16_ONLY
from adapters.vllm.profile import PINNED_VLLM
from app.config import load_config
from domain.errors import ConfigError, EngineRejectsQuantization, UnsupportedCombination
from domain.quant import dispatch
from domain.quant.dispatch import MODEL_RULES, RESOLUTION_RULES, rules_for
from domain.quant.dispatch_types import DispatchContext, DispatchInput, EngineDispatch, Rule
from domain.quant.formats import ActivationScheme
from domain.quant.plan import QuantizationPlan
from domain.quant.support import COMPRESSED_TENSORS, Cell, SupportTable, Verdict

NVFP4 = QuantizationPlan.from_presets(linear="NVFP4", linear_activation="none")


def test_every_engine_has_a_profile_and_the_configuration_offers_exactly_those() -> None:
    assert ENGINES == tuple(PROFILES) == ("vllm", "sglang", "trtllm", "reference")
    for name, profile in PROFILES.items():
        assert profile.name == profile.dispatch.name == name
    assert PINNED_ENGINES == {"vllm": PINNED_VLLM, "sglang": PINNED_SGLANG}
    assert {"vllm", "sglang", "torch"} <= set(DISTRIBUTIONS)
    with pytest.raises(ConfigError, match=r"rollout\.name"):
        load_config({"rollout": {"name": "tgi"}})


def test_an_unknown_engine_is_a_config_error_naming_the_engines() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.name.*vllm, sglang, trtllm, reference"):
        profile_for("tgi")


def test_a_profile_carries_its_own_engines_dispatch_only() -> None:
    with pytest.raises(ValueError, match="dispatch rules of 'sglang'"):
        StaticEngineProfile("vllm", EngineDispatch("sglang"))


def test_a_support_table_holds_only_its_engines_cells() -> None:
    cell = Cell("sglang", COMPRESSED_TENSORS, "linear", "NVFP4", ActivationScheme.NONE)
    with pytest.raises(ValueError, match="another engine"):
        SupportTable("vllm", PINNED_VLLM, [Verdict(cell, True, "x", ("sglang 1 sglang/a.py:1",))])


def test_the_dispatch_refuses_the_rules_of_another_engine() -> None:
    with pytest.raises(ValueError, match=r"rollout\.name=vllm.*sglang's"):
        dispatch.resolve(DispatchInput(engine="vllm"), engine=dispatch_for("sglang"))


def test_the_rules_run_in_order_with_the_engines_own_between() -> None:
    engine = dispatch_for("vllm")
    assert rules_for(engine) == (*RESOLUTION_RULES, *engine.rules, *MODEL_RULES)
    assert [r.name for r in RESOLUTION_RULES] == ["QatMatchesRollout", "QuantizedFullSync", "DynamicActivationsOnly",
                                                  "EngineSupportMatrix"]
    assert [r.name for r in MODEL_RULES] == ["UniformFusedGroups", "FirstLastLayersBf16", "BlockDivisibility"]
    assert BF16_ONLY in engine.rules  # every engine lists TRT-LLM's rule, n/a for it


def test_an_engine_rule_is_n_a_for_the_other_engines() -> None:
    quantized = DispatchInput(engine="vllm", requested=NVFP4)
    assert ("TrtllmBf16Only", "n/a") in {(o.rule, o.outcome) for o in
                                               dispatch.resolve(quantized, engine=dispatch_for("vllm")).outcomes}
    trtllm = attrs.evolve(quantized, engine="trtllm")
    with pytest.raises(EngineRejectsQuantization, match=r"rollout\.name=trtllm accepts no rollout quantization"):
        dispatch.resolve(trtllm, engine=dispatch_for("trtllm"))
    ok = dispatch.resolve(DispatchInput(engine="trtllm"), engine=dispatch_for("trtllm"))
    assert ("TrtllmBf16Only", "ok") in {(o.rule, o.outcome) for o in ok.outcomes}


def _refuse(ctx: DispatchContext) -> None:
    if ctx.plan.is_quantized:
        raise UnsupportedCombination(f"rollout.name={ctx.engine.name} serves BF16 only")


def test_a_rule_an_engine_contributes_runs_after_the_support_matrix_and_prints_its_outcome() -> None:
    own = Rule("ToyBf16Only", "BF16 only", _refuse, lambda c: "ok: BF16")
    engine = EngineDispatch("toy", NATIVE_LAYOUTS, rules=(own,))
    res = dispatch.resolve(DispatchInput(engine="toy"), engine=engine)
    assert ("ToyBf16Only", "BF16 only", "ok: BF16") in {(o.rule, o.summary, o.outcome) for o in res.outcomes}
    names = [o.rule for o in res.outcomes]
    assert names.index("EngineSupportMatrix") < names.index("ToyBf16Only") < names.index("FirstLastLayersBf16")
    with pytest.raises(UnsupportedCombination, match="toy serves BF16 only"):
        dispatch.resolve(DispatchInput(engine="toy", requested=NVFP4), engine=engine)
    silent = EngineDispatch("toy", NATIVE_LAYOUTS, rules=(Rule("ToyQuiet", "quiet", _refuse, lambda c: None),))
    assert "ToyQuiet" not in {o.rule for o in dispatch.resolve(DispatchInput(engine="toy"), engine=silent).outcomes}


def test_the_layout_choice_is_the_engines() -> None:
    mxfp8 = QuantizationPlan.from_presets(linear="MXFP8", moe="MXFP8")
    assert dispatch_for("sglang").layout_for(mxfp8, None) == "sglang-mxfp8"
    assert dispatch_for("vllm").layout_for(mxfp8, None) == COMPRESSED_TENSORS
    assert dispatch_for("reference").layout_for(QuantizationPlan.bf16(), None) == "bf16"


def test_only_the_sglang_adapter_checks_its_own_refusals() -> None:
    mixed = QuantizationPlan.from_presets(linear="MXFP8", moe="MXFP4")
    with pytest.raises(EngineRejectsQuantization, match=r"does not serve rollout\.quantization\.linear=MXFP8"):
        profile_for("sglang").check_plan(mixed)
    for other in ("vllm", "trtllm", "reference"):
        profile_for(other).check_plan(mixed)  # their adapters make no such check


def test_profiles_without_a_table_cover_no_cells() -> None:
    assert profile_for("reference").support_cells() == [] and profile_for("trtllm").support is None
    assert len(profile_for("vllm").support_cells()) == len(profile_for("vllm").support.verdicts)  # type: ignore[union-attr]
