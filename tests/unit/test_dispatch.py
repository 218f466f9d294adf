"""Every dispatch rule of docs/plan.md#the-dispatch-rules: one test (or more) per rule and error type."""

from __future__ import annotations

import json

import pytest

from adapters.profiles import dispatch_for
from domain.errors import (
    BoundaryLayersMismatch,
    ConfigError,
    EngineRejectsQuantization,
    FusedGroupSplit,
    NativeLayoutOverride,
    NativeRefitUnsupported,
    NonDivisibleTensors,
    QatModeMismatch,
    QatWithTeRecipe,
    QuantizedDeltaSync,
    RefitError,
    UnsupportedCombination,
    UnsupportedQuantMethod,
)
from domain.quant import dispatch, model_rules
from domain.quant.formats import FP8_BLOCK, MXFP8, ActivationScheme
from domain.quant.plan import QuantizationPlan
from tests.dispatching import DispatchInput, layout_for, resolve

GPT_OSS = {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}}
DEEPSEEK_FP8 = {"model_type": "deepseek_v3", "quantization_config": {
    "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}}
DEEPSEEK_V4 = {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"],
               "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
CT_NVFP4 = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
    "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "dynamic": True}}},
    "ignore": ["lm_head"]}


def plan(**kw: object) -> QuantizationPlan:
    return QuantizationPlan.from_presets(**kw)  # type: ignore[arg-type]


def dense_shapes(layers: int = 4, k: int = 64) -> list[tuple[str, tuple[int, ...]]]:
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (128, k))]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [(f"{p}.self_attn.{x}_proj.weight", (64, k)) for x in "qkvo"]
        out += [(f"{p}.mlp.{x}_proj.weight", (128, k)) for x in ("gate", "up")] + [(f"{p}.mlp.down_proj.weight", (k, 128))]
    return [*out, ("lm_head.weight", (128, k))]


def test_every_error_is_a_refit_error_and_its_builtin() -> None:
    assert issubclass(UnsupportedQuantMethod, NotImplementedError)
    for err in (QatModeMismatch, NativeLayoutOverride, QuantizedDeltaSync, QatWithTeRecipe,
                EngineRejectsQuantization, BoundaryLayersMismatch, FusedGroupSplit, NonDivisibleTensors):
        assert issubclass(err, RefitError) and issubclass(err, ValueError)


# --- source selection and precedence --------------------------------------------------------------

def test_nothing_requested_is_bf16() -> None:
    res = resolve(DispatchInput())
    assert (res.source, res.layout, res.is_quantized) == ("none", "bf16", False)


def test_checkpoint_quantization_config_is_detected_at_top_level_and_under_text_config() -> None:
    top = resolve(DispatchInput(model_config={"quantization_config": CT_NVFP4}))
    nested = resolve(DispatchInput(model_config={"text_config": {"quantization_config": CT_NVFP4}}))
    for res in (top, nested):
        assert res.source == "checkpoint" and res.plan.linear.name == "NVFP4" and res.layout == "compressed-tensors"


def test_hf_overrides_take_precedence_over_the_checkpoint_dict_or_json_string() -> None:
    weight_only = {**CT_NVFP4, "config_groups": {"group_0": {
        k: v for k, v in CT_NVFP4["config_groups"]["group_0"].items() if k != "input_activations"}}}
    override = {"quantization_config": weight_only}  # vLLM serves NVFP4 weight-only
    for value in (override, json.dumps(override)):
        res = resolve(DispatchInput(engine="vllm", hf_overrides=value, model_config=DEEPSEEK_FP8))
        assert res.source == "hf_overrides" and res.plan.linear.name == "NVFP4"


def test_explicit_null_override_means_bf16() -> None:
    res = resolve(DispatchInput(engine="vllm", hf_overrides={"quantization_config": None}, model_config=DEEPSEEK_FP8))
    assert (res.source, res.layout, res.plan.is_quantized) == ("hf_overrides", "bf16", False)


def test_bad_hf_overrides_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"not valid JSON") as err:
        resolve(DispatchInput(engine="vllm", hf_overrides="{nope"))
    assert err.value.key == "rollout.engine_kwargs.vllm.hf_overrides"
    with pytest.raises(ConfigError, match=r"must be a dict or null"):
        resolve(DispatchInput(engine="vllm", hf_overrides={"quantization_config": "fp8"}))


def test_two_sources_at_once_are_rejected() -> None:
    with pytest.raises(UnsupportedCombination, match=r"are both set"):
        resolve(DispatchInput(engine="vllm", requested=plan(linear="MXFP8"), hf_overrides={"quantization_config": None}))


def test_native_deepseek_fp8_is_recognised_and_exported_with_weight_scale_inv() -> None:
    res = resolve(DispatchInput(engine="vllm", model_config=DEEPSEEK_FP8))
    assert (res.layout, res.plan.linear, res.plan.moe, res.plan.scale_name) == ("native-fp8", FP8_BLOCK, FP8_BLOCK, "weight_scale_inv")


def test_sglang_all_mxfp8_becomes_native_mxfp8() -> None:
    res = resolve(DispatchInput(engine="sglang", requested=plan(linear="MXFP8", moe="MXFP8")))
    assert (res.layout, res.plan.scale_name) == ("sglang-mxfp8", "weight_scale_inv")
    assert resolve(DispatchInput(engine="sglang", requested=plan(linear="MXFP8"))).layout == "sglang-mxfp8"
    assert resolve(DispatchInput(engine="vllm", requested=plan(linear="MXFP8"))).layout == "compressed-tensors"
    assert resolve(DispatchInput(engine="sglang", requested=plan(linear="FP8_BLOCK"))).layout == "compressed-tensors"


# --- UnexportableNativeMethod ---------------------------------------------------------------------

def test_unexportable_native_method_unsupported_native_method_is_copied_untouched_by_export() -> None:
    res = resolve(DispatchInput(engine="vllm", model_config=GPT_OSS, purpose="export"))
    assert res.layout == "native-passthrough" and not res.plan.is_quantized and res.is_quantized
    assert res.native is not None and res.native.method == "mxfp4" and res.served is None


def test_unexportable_native_method_a_refit_of_a_native_layout_the_trainer_cannot_produce_is_refused() -> None:
    # The engine would be configured for mxfp4 experts while the refit sends BF16 tensors.
    with pytest.raises(NativeRefitUnsupported, match=r"'mxfp4'.*send BF16 tensors.*dispatch rule UnexportableNativeMethod") as err:
        resolve(DispatchInput(engine="vllm", model_config=GPT_OSS))
    assert isinstance(err.value, UnsupportedQuantMethod)
    # what the message offers instead works: a preset the trainer exports, or BF16
    assert resolve(DispatchInput(engine="vllm", model_config=GPT_OSS, requested=plan(moe="MXFP4"))).plan.is_quantized
    bf16 = resolve(DispatchInput(engine="vllm", model_config=GPT_OSS, hf_overrides={"quantization_config": None}))
    assert bf16.layout == "bf16"


def test_unexportable_native_method_unsupported_method_with_qat_or_override_is_not_implemented() -> None:
    with pytest.raises(UnsupportedQuantMethod, match=r"'mxfp4'.*qat.enable"):
        resolve(DispatchInput(engine="vllm", model_config=GPT_OSS, qat_enable=True, qat_mode="MXFP4"))
    with pytest.raises(UnsupportedQuantMethod, match=r"'gptq'.*hf_overrides") as err:
        resolve(DispatchInput(engine="vllm", hf_overrides={"quantization_config": {"quant_method": "gptq", "bits": 4}}))
    assert isinstance(err.value, NotImplementedError)


# --- QatMatchesRollout ----------------------------------------------------------------------------

def test_qat_matches_rollout_qat_mode_must_match_the_rollout() -> None:
    ok = resolve(DispatchInput(requested=plan(linear="NVFP4", moe="NVFP4"), qat_enable=True, qat_mode="nvfp4"))
    assert ok.plan.linear.name == "NVFP4"
    with pytest.raises(QatModeMismatch, match=r"qat.mode='MXFP4'.*NVFP4"):
        resolve(DispatchInput(requested=plan(linear="NVFP4"), qat_enable=True, qat_mode="MXFP4"))
    with pytest.raises(QatModeMismatch, match=r"BF16"):
        resolve(DispatchInput(qat_enable=True, qat_mode="MXFP4"))
    with pytest.raises(QatModeMismatch, match=r"FP8_BLOCK, NVFP4"):
        resolve(DispatchInput(requested=plan(linear="FP8_BLOCK", moe="NVFP4"), qat_enable=True, qat_mode="NVFP4"))


@pytest.mark.parametrize(("mode", "rollout"), [
    ("fp8", {"linear": "FP8_BLOCK", "moe": "FP8_BLOCK"}),
    ("FP8_BLOCK", {"linear": "FP8_BLOCK"}),
    ("mxfp8", {"linear": "MXFP8", "moe": "MXFP8"}),
    ("mxfp4", {"moe": "MXFP4"}),
    ("mxfp4_mxfp8", {"moe": "MXFP4", "moe_activation": "mxfp8"}),
    ("nvfp4", {"linear": "NVFP4", "moe": "NVFP4"}),
    ("w4a16", {"linear": "NVFP4", "linear_activation": "none"}),
])
def test_qat_matches_rollout_verl_qat_modes_map_to_a_preset_and_an_activation_kind(mode: str, rollout: dict) -> None:
    # the reference engine serves every plan: QatMatchesRollout alone decides (per-token NVFP4 is not served by vLLM)
    res = resolve(DispatchInput(engine="reference", requested=plan(**rollout), qat_enable=True, qat_mode=mode))
    assert res.plan.is_quantized


@pytest.mark.parametrize(("mode", "rollout", "reason"), [
    ("mxfp4_mxfp8", {"moe": "MXFP4"}, r"trains MXFP4 weights, mxfp8 activations.*mxfp4 activations; set qat.mode=mxfp4, "
                                      r"or set rollout.quantization.moe_activation=mxfp8"),
    ("mxfp4", {"moe": "MXFP4", "moe_activation": "mxfp8"}, r"set qat.mode=mxfp4_mxfp8"),
    ("nvfp4", {"linear": "NVFP4", "linear_activation": "none"}, r"set qat.mode=w4a16"),
    ("fp8", {"linear": "FP8_BLOCK", "linear_activation": "none"}, r"no QAT mode trains FP8_BLOCK with none activations"),
    ("mxfp8", {"moe": "MXFP4"}, r"qat.mode='mxfp8' does not match.*set qat.mode to mxfp4"),
])
def test_qat_matches_rollout_a_qat_mode_that_cannot_match_the_rollout_says_why(mode: str, rollout: dict, reason: str) -> None:
    with pytest.raises(QatModeMismatch, match=reason):
        resolve(DispatchInput(engine="vllm", requested=plan(**rollout), qat_enable=True, qat_mode=mode))


def test_qat_matches_rollout_verls_static_nvfp4_mode_is_rejected_with_the_reason() -> None:
    with pytest.raises(ConfigError, match=r"'w4a4' cannot be matched.*static NVFP4 activation scales.*use mode nvfp4"):
        resolve(DispatchInput(requested=plan(linear="NVFP4"), qat_enable=True, qat_mode="w4a4"))
    assert resolve(DispatchInput(requested=plan(linear="NVFP4"), qat_mode="w4a4")).plan.is_quantized  # QAT off


def test_qat_matches_rollout_qat_ignore_patterns_must_stay_bf16_in_the_rollout() -> None:
    inp = DispatchInput(requested=plan(linear="NVFP4"), qat_enable=True, qat_mode="NVFP4", qat_ignore=("*o_proj",))
    with pytest.raises(QatModeMismatch, match=r"\*o_proj"):
        resolve(inp, dense_shapes())
    fixed = DispatchInput(requested=plan(linear="NVFP4", ignore=["*o_proj"]), qat_enable=True, qat_mode="NVFP4",
                          qat_ignore=("*o_proj",))
    assert resolve(fixed, dense_shapes()).plan.is_quantized


# --- NativeReleaseLayout --------------------------------------------------------------------------

def test_native_release_layout_release_layout_model_passes_its_native_config_through() -> None:
    res = resolve(DispatchInput(engine="vllm", model_config=DEEPSEEK_V4))
    assert res.layout == "native-passthrough" and res.native is not None and res.native.config["quant_method"] == "fp8"


@pytest.mark.parametrize("extra", [
    {"requested": QuantizationPlan.from_presets(linear="NVFP4")},
    {"hf_overrides": {"quantization_config": None}},
    {"config_file": CT_NVFP4},
])
def test_native_release_layout_release_layout_model_rejects_overrides(extra: dict) -> None:
    with pytest.raises(NativeLayoutOverride, match=r"deepseek_v4"):
        resolve(DispatchInput(engine="vllm", model_config=DEEPSEEK_V4, **extra))


# --- QuantizedFullSync ----------------------------------------------------------------------------

def test_quantized_full_sync_quantized_rollout_rejects_delta_sync() -> None:
    with pytest.raises(QuantizedDeltaSync, match=r"checkpoint_engine.backend='delta_sharded'"):
        resolve(DispatchInput(requested=plan(moe="MXFP4"), sync_backend="delta_sharded"))
    with pytest.raises(QuantizedDeltaSync, match=r"wire_format='delta_flush'"):
        resolve(DispatchInput(requested=plan(moe="MXFP4"), wire_format="delta_flush"))
    with pytest.raises(QuantizedDeltaSync):  # native pass-through is quantized too
        resolve(DispatchInput(model_config=GPT_OSS, sync_backend="delta_sharded", purpose="export"))
    with pytest.raises(QuantizedDeltaSync, match=r"dispatch rule QuantizedFullSync"):  # native FP8 the trainer exports
        resolve(DispatchInput(model_config=DEEPSEEK_FP8, sync_backend="delta_sharded"))


@pytest.mark.parametrize(("extra", "error"), [
    ({"sync_backend": "delta_sharded"}, QuantizedDeltaSync),
    ({"wire_format": "delta_flush"}, QuantizedDeltaSync),
    ({"engine": "trtllm"}, EngineRejectsQuantization),
    ({"qat_enable": True, "qat_mode": "nvfp4"}, QatModeMismatch),
])
def test_release_layout_models_go_through_every_rule(extra: dict, error: type) -> None:
    # DeepSeek-V4 passes its native FP8 through (NativeReleaseLayout), and is still a quantized rollout.
    with pytest.raises(error):
        resolve(DispatchInput(model_config=DEEPSEEK_V4, **extra))
    res = resolve(DispatchInput(model_config=DEEPSEEK_V4, qat_enable=True, qat_mode="fp8"))
    assert res.is_quantized and res.served is not None and res.served.linear is FP8_BLOCK
    assert not resolve(DispatchInput(sync_backend="delta_sharded", wire_format="delta_flush")).is_quantized


# --- QatExcludesTeRecipe --------------------------------------------------------------------------

@pytest.mark.parametrize(("fp8", "fp4"), [("e4m3", None), (None, "e2m1"), ("hybrid", "e2m1")])
def test_qat_excludes_te_recipe_qat_and_te_recipe_are_exclusive(fp8: str | None, fp4: str | None) -> None:
    with pytest.raises(QatWithTeRecipe, match=r"override_transformer_config"):
        resolve(DispatchInput(requested=plan(linear="NVFP4"), qat_enable=True, qat_mode="NVFP4", te_fp8=fp8, te_fp4=fp4))
    assert resolve(DispatchInput(requested=plan(linear="NVFP4"), te_fp8=fp8, te_fp4=fp4)).plan.is_quantized


# --- EngineSupportMatrix --------------------------------------------------------------------------

def test_engine_support_matrix_sglang_rejects_mxfp8_linear_with_mxfp4_moe() -> None:
    # mixed precision: compressed-tensors MXFP8 Linear, which SGLang has no scheme for
    with pytest.raises(EngineRejectsQuantization, match=r"linear=MXFP8 with mxfp8 activations.*NotImplementedError"):
        resolve(DispatchInput(engine="sglang", requested=plan(linear="MXFP8", moe="MXFP4")))
    assert resolve(DispatchInput(engine="vllm", requested=plan(linear="MXFP8", moe="MXFP4"))).plan.is_quantized


def test_engine_support_matrix_per_token_nvfp4_experts_only_on_vllm_in_modelopts_layout() -> None:
    with pytest.raises(EngineRejectsQuantization, match=r"moe=NVFP4 with nvfp4_per_token.*input_global_scale"):
        resolve(DispatchInput(engine="sglang", requested=plan(moe="NVFP4")))
    res = resolve(DispatchInput(engine="vllm", requested=plan(moe="NVFP4")))
    assert res.layout == "modelopt-nvfp4" and res.plan.expert_layout == "modelopt"
    with pytest.raises(EngineRejectsQuantization, match=r"moe=NVFP4 with nvfp4_per_token.*input_global_scale"):
        resolve(DispatchInput(engine="vllm", requested=plan(linear="FP8_BLOCK", moe="NVFP4")))
    for engine in ("sglang", "vllm"):
        assert resolve(DispatchInput(engine=engine, requested=plan(moe="NVFP4", moe_activation="none"))).plan.is_quantized


# --- TrtllmBf16Only -------------------------------------------------------------------------------

def test_trtllm_bf16_only_trtllm_accepts_no_quantization() -> None:
    with pytest.raises(EngineRejectsQuantization, match=r"vllm.*sglang"):
        resolve(DispatchInput(engine="trtllm", requested=plan(linear="FP8_BLOCK")))
    with pytest.raises(EngineRejectsQuantization):
        resolve(DispatchInput(engine="trtllm", model_config=DEEPSEEK_FP8))
    assert not resolve(DispatchInput(engine="trtllm")).is_quantized


# --- FirstLastLayersBf16 --------------------------------------------------------------------------

def test_first_last_layers_bf16_bf16_training_layers() -> None:
    assert model_rules.bf16_training_layers(10, enabled=True, at_start=1, at_end=2) == {0, 8, 9}
    assert model_rules.bf16_training_layers(10, enabled=False, at_start=1, at_end=2) == set()
    assert model_rules.bf16_training_layers(2, enabled=True, at_start=3, at_end=3) == {0, 1}


def test_first_last_layers_bf16_nvfp4_training_boundary_layers_must_be_bf16_in_the_rollout() -> None:
    te = {"te_fp4": "e2m1", "first_last_layers_bf16": True}
    with pytest.raises(BoundaryLayersMismatch, match=r"layers \[0, 3\].*re:\.\*layers\\\\\.\(0\|3\)"):
        resolve(DispatchInput(requested=plan(linear="NVFP4"), **te), dense_shapes())
    entry = model_rules.layer_ignore_entry([0, 3])
    res = resolve(DispatchInput(requested=plan(linear="NVFP4", ignore=[entry]), **te), dense_shapes())
    assert "[0, 3]" in next(o.outcome for o in res.outcomes if o.rule == "FirstLastLayersBf16")
    # BF16 training or no boundary setting: nothing to agree on
    assert resolve(DispatchInput(requested=plan(linear="NVFP4"), first_last_layers_bf16=True), dense_shapes()).plan.is_quantized


# --- BlockDivisibility and UniformFusedGroups -----------------------------------------------------

def test_block_divisibility_non_divisible_tensors_are_listed_with_the_ignore_entry() -> None:
    shapes = [*dense_shapes(layers=1), ("model.layers.0.linear_attn.out_proj.weight", (16, 40))]
    with pytest.raises(NonDivisibleTensors, match=r"1 tensor") as err:
        resolve(DispatchInput(requested=plan(linear="NVFP4")), shapes)
    assert err.value.patterns == ("re:.*\\.out_proj$",)
    ok = resolve(DispatchInput(requested=plan(linear="NVFP4", ignore=list(err.value.patterns))), shapes)
    assert ok.plan.is_quantized
    assert resolve(DispatchInput(requested=plan(linear="FP8_BLOCK")), shapes).plan.is_quantized  # edge blocks allowed


def test_block_divisibility_fix_keeps_fused_groups_whole() -> None:
    # Only q_proj is misaligned; keeping just q_proj in BF16 would split q/k/v (FusedGroupSplit).
    shapes = [("model.layers.0.self_attn.q_proj.weight", (64, 48)), ("model.layers.0.self_attn.k_proj.weight", (32, 64)),
              ("model.layers.0.self_attn.v_proj.weight", (32, 64)), ("model.layers.0.self_attn.o_proj.weight", (64, 64))]
    with pytest.raises(NonDivisibleTensors) as err:
        resolve(DispatchInput(requested=plan(linear="MXFP4")), shapes)
    assert err.value.tensors == ("model.layers.0.self_attn.q_proj.weight",)
    assert set(err.value.patterns) == {"re:.*\\.q_proj$", "re:.*\\.k_proj$", "re:.*\\.v_proj$"}
    assert "['re:.*\\.q_proj$', 're:.*\\.k_proj$', 're:.*\\.v_proj$']" in str(err.value)  # paste-able YAML
    res = resolve(DispatchInput(requested=plan(linear="MXFP4", ignore=list(err.value.patterns))), shapes)
    assert res.plan.decide("model.layers.0.self_attn.o_proj.weight", (64, 64)).is_quantized


def test_fused_group_split_by_ignore_is_rejected() -> None:
    with pytest.raises(FusedGroupSplit, match=r"q_proj.*self_attn.qkv"):
        resolve(DispatchInput(requested=plan(linear="MXFP8", ignore=["model.layers.0.self_attn.q_proj"])), dense_shapes())


def test_rules_without_a_model_are_reported_as_skipped() -> None:
    res = resolve(DispatchInput(requested=plan(linear="MXFP8")))
    skipped = {o.rule for o in res.outcomes if o.outcome.startswith("skipped")}
    assert skipped == {"UniformFusedGroups", "FirstLastLayersBf16", "BlockDivisibility"}
    # every rule of the engine has its line, in the order the rules run
    assert [o.rule for o in res.outcomes] == list(dispatch.rule_names(dispatch_for("reference")))


def test_static_nvfp4_activations_are_rejected() -> None:
    with pytest.raises(UnsupportedCombination, match=r"input_global_scale"):
        resolve(DispatchInput(requested=QuantizationPlan.from_presets(moe="NVFP4", moe_activation="nvfp4_static")))


def test_layout_for_the_plan() -> None:
    assert layout_for("vllm", QuantizationPlan.bf16(), None) == "bf16"
    assert layout_for("sglang", QuantizationPlan(linear=MXFP8, moe=MXFP8), None) == "sglang-mxfp8"
    assert QuantizationPlan(moe=MXFP8, moe_activation=ActivationScheme.NONE).effective_moe_activation is ActivationScheme.NONE


def test_docs_support_matrix_matches_the_rules() -> None:
    from pathlib import Path

    import domain.errors as errors

    text = (Path(__file__).resolve().parents[2] / "docs" / "support-matrix.md").read_text()
    text = text.split("\n## By preset pair", 1)[1].split("\n## Cells", 1)[0]
    layouts = {"BF16": "bf16", "ct": "compressed-tensors", "mxfp8-native": "sglang-mxfp8", "modelopt": "modelopt-nvfp4"}
    checked = 0
    for section in text.split("\n### ")[1:]:
        section = section.split("\n## ")[0]
        engine = section.split("\n", 1)[0].strip()
        rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines() if line.startswith("| ")]
        header, body = rows[0][1:], rows[1:]
        for row in body:
            for moe, cell in zip(header, row[1:], strict=True):
                inp = DispatchInput(engine=engine, requested=plan(linear=row[0], moe=moe))
                if cell.startswith("✗"):
                    with pytest.raises(getattr(errors, cell.removeprefix("✗").strip())):
                        resolve(inp)
                else:
                    assert resolve(inp).layout == layouts[cell], (engine, row[0], moe)
                checked += 1
    assert checked == 4 * 25
