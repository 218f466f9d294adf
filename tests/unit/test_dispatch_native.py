"""Reading quantization_configs (checkpoint, hf_overrides, config_file) into plans."""

from __future__ import annotations

import pytest

from domain.quant.formats import BF16, FP8_BLOCK, MXFP4, MXFP8, NVFP4, ActivationScheme
from domain.quant.native_config import (
    OVERRIDE_ABSENT,
    find_quantization_config,
    override_quantization_config,
    parse_quantization_config,
)

W_NVFP4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
W_MXFP4 = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}
W_MXFP8 = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32}
W_FP8B = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}
A_FP8G = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True}


def ct(*groups: tuple[list[str], dict, dict | None], ignore: list[str] | None = None) -> dict:
    cg = {f"group_{i}": {"targets": t, "weights": w, "input_activations": a} for i, (t, w, a) in enumerate(groups)}
    return {"quant_method": "compressed-tensors", "config_groups": cg, "ignore": ignore or []}


def test_one_linear_group_quantizes_dense_and_experts() -> None:
    nc = parse_quantization_config(ct((["Linear"], W_FP8B, A_FP8G), ignore=["lm_head", "re:.*mlp.gate$"]))
    assert nc.exportable and nc.method == "compressed-tensors"
    assert (nc.plan.linear, nc.plan.moe) == (FP8_BLOCK, FP8_BLOCK)
    assert nc.plan.ignore == ("re:.*mlp.gate$",)  # lm_head is a default already


def test_mixed_precision_experts_group_wins_over_linear() -> None:
    a_mxfp8 = {**W_MXFP8, "dynamic": True}
    nc = parse_quantization_config(ct(([r"re:.*mlp\.experts.*"], W_MXFP4, a_mxfp8), (["Linear"], W_NVFP4, None)))
    assert (nc.plan.linear, nc.plan.moe) == (NVFP4, MXFP4)
    assert nc.plan.moe_activation is ActivationScheme.MXFP8
    assert nc.plan.linear_activation is ActivationScheme.NONE  # weight-only dense layers


def test_linear_with_experts_ignored_is_dense_only() -> None:
    nc = parse_quantization_config(ct((["Linear"], W_MXFP8, None), ignore=[r"re:.*\.experts(\..*)?$"]))
    assert (nc.plan.linear, nc.plan.moe) == (MXFP8, BF16)


def test_nvfp4_activation_kinds() -> None:
    local = {**W_NVFP4, "dynamic": "local"}
    per_token = {**W_NVFP4, "dynamic": True}
    assert parse_quantization_config(ct((["Linear"], W_NVFP4, local))).plan.linear_activation is ActivationScheme.NVFP4_STATIC
    assert parse_quantization_config(ct((["Linear"], W_NVFP4, per_token))).plan.linear_activation is None


@pytest.mark.parametrize("qc", [
    {"quant_method": "mxfp4"},
    {"quant_method": "gptq", "bits": 4},
    {"quant_method": "fp8", "activation_scheme": "static"},  # per-tensor FP8
    ct((["Linear"], {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}, None)),
    ct((["Linear"], {"num_bits": 8, "type": "float", "strategy": "channel"}, None)),
    {"quant_method": "compressed-tensors", "config_groups": {}},
    ct((["re:.*lm_head"], W_MXFP8, None)),
])
def test_methods_the_trainer_cannot_export(qc: dict) -> None:
    nc = parse_quantization_config(qc)
    assert not nc.exportable and nc.problem


def test_native_fp8_and_mxfp8_use_weight_scale_inv() -> None:
    fp8 = parse_quantization_config({"quant_method": "fp8", "weight_block_size": [128, 128],
                                     "modules_to_not_convert": ["model.layers.0.mlp.gate"]})
    assert (fp8.plan.linear, fp8.plan.scale_name, fp8.plan.ignore) == (FP8_BLOCK, "weight_scale_inv", ("model.layers.0.mlp.gate",))
    mx = parse_quantization_config({"quant_method": "mxfp8", "weight_block_size": [1, 32], "ignored_layers": ["lm_head"]})
    assert (mx.plan.linear, mx.plan.moe, mx.plan.scale_name) == (MXFP8, MXFP8, "weight_scale_inv")


def test_find_and_override_lookup() -> None:
    qc = {"quant_method": "fp8"}
    assert find_quantization_config({"quantization_config": qc}) == ("quantization_config", qc)
    assert find_quantization_config({"text_config": {"quantization_config": qc}}) == ("text_config.quantization_config", qc)
    assert find_quantization_config({"model_type": "qwen3"}) is None and find_quantization_config(None) is None
    key = "rollout.engine_kwargs.vllm.hf_overrides"
    assert override_quantization_config(None, key) is OVERRIDE_ABSENT
    assert override_quantization_config({"max_model_len": 4}, key) is OVERRIDE_ABSENT
    assert override_quantization_config({"quantization_config": None}, key) is None
    assert override_quantization_config('{"text_config": {"quantization_config": {"quant_method": "fp8"}}}', key) == qc


# --- compressed-tensors configs as written (domain.quant.ct_config) ---------------------------------

from domain.errors import ConfigNotHonoured  # noqa: E402
from domain.quant.ct_config import model_differences, read_compressed_tensors  # noqa: E402
from tests.dispatching import DispatchInput, resolve  # noqa: E402

A_MXFP8 = {**W_MXFP8, "dynamic": True}


def _with(qc: dict, **fields: object) -> dict:
    return {**qc, **fields}


@pytest.mark.parametrize(("qc", "field"), [
    (ct(([r"re:.*self_attn.*"], W_FP8B, A_FP8G), (["Linear"], W_MXFP8, A_MXFP8)), "two formats"),
    (ct((["QKVParallelLinear"], W_FP8B, A_FP8G), (["Linear"], W_FP8B, A_FP8G)), "module classes other than 'Linear'"),
    (_with(ct((["Linear"], W_FP8B, A_FP8G)), quantization_status="frozen"), "quantization_status='frozen'"),
    (_with(ct((["Linear"], W_NVFP4, None)), format="float-quantized"), "compression format 'float-quantized'"),
    (_with(ct((["Linear"], W_FP8B, A_FP8G)), transform_config={"config_groups": {"r": {}}}), "transform_config"),
    (ct((["Linear"], {**W_FP8B, "actorder": "group"}, A_FP8G)), "actorder"),
    (ct((["Linear"], W_FP8B, A_FP8G), (["re:.*mlp.*"], {"num_bits": 4, "type": "int", "strategy": "group",
                                                      "group_size": 128}, None)), "is not one of the presets"),
])
def test_fields_that_cannot_be_honoured_are_named(qc: dict, field: str) -> None:
    reading = read_compressed_tensors(qc)
    assert reading.plan is not None and any(field in d for d in reading.differences), reading.differences
    with pytest.raises(ConfigNotHonoured, match=field.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        resolve(DispatchInput(engine="vllm", config_file=qc))
    rewritten = resolve(DispatchInput(engine="vllm", config_file=qc, allow_config_rewrite=True))
    assert not rewritten.as_written and rewritten.plan.is_quantized and rewritten.plan.targets == ()
    outcome = next(o.outcome for o in rewritten.outcomes if o.rule == "ConfigAsWritten")
    assert outcome.startswith("rewritten") and field in outcome


def test_a_checkpoints_own_config_is_rewritten_with_the_changes_listed_not_rejected() -> None:
    qc = _with(ct((["Linear"], W_FP8B, A_FP8G)), quantization_status="frozen")
    res = resolve(DispatchInput(engine="vllm", model_config={"quantization_config": qc}))
    assert not res.as_written and "quantization_status" in next(o.outcome for o in res.outcomes if o.rule == "ConfigAsWritten")


def test_a_clean_config_is_sent_as_written() -> None:
    qc = ct((["Linear"], W_FP8B, A_FP8G), ignore=["lm_head"])
    res = resolve(DispatchInput(engine="vllm", config_file=qc))
    assert res.as_written and res.plan.linear is FP8_BLOCK
    assert "as written" in next(o.outcome for o in res.outcomes if o.rule == "ConfigAsWritten")


def test_sglangs_native_mxfp8_layout_is_not_the_config_as_written() -> None:
    qc = ct((["Linear"], W_MXFP8, A_MXFP8))
    with pytest.raises(ConfigNotHonoured, match=r"sglang-mxfp8 layout"):
        resolve(DispatchInput(engine="sglang", config_file=qc))
    assert resolve(DispatchInput(engine="sglang", config_file=qc, allow_config_rewrite=True)).layout == "sglang-mxfp8"


def test_groups_limited_to_some_layers_quantize_only_those() -> None:
    qc = ct(([r"re:model\.layers\.(1[0-9])\..*"], W_MXFP8, A_MXFP8))
    plan = read_compressed_tensors(qc).plan
    assert plan is not None and plan.linear is MXFP8 and len(plan.targets) == 1
    assert plan.decide("model.layers.12.mlp.down_proj.weight", (64, 64)).format is MXFP8
    d = plan.decide("model.layers.2.mlp.down_proj.weight", (64, 64))
    assert d.format is BF16 and "no config group targets it" in d.reason


def test_config_ignore_entries_keep_compressed_tensors_exact_name_meaning() -> None:
    plan = read_compressed_tensors(ct((["Linear"], W_FP8B, A_FP8G), ignore=["o_proj", "model.layers.0.mlp.down_proj"])).plan
    assert plan is not None
    assert plan.decide("model.layers.0.self_attn.o_proj.weight", (64, 64)).format is FP8_BLOCK  # not a suffix
    assert plan.decide("model.layers.0.mlp.down_proj.weight", (64, 64)).format is BF16
    assert plan.decide("model.layers.1.mlp.down_proj.weight", (64, 64)).format is FP8_BLOCK


def test_with_a_model_every_tensor_the_config_quantizes_must_be_quantized_alike() -> None:
    shapes = [("model.layers.0.linear_attn.in_proj_ba.weight", (8, 64)), ("model.layers.0.mlp.down_proj.weight", (64, 64)),
              ("model.layers.0.mlp.gate.weight", (4, 64)), ("lm_head.weight", (128, 64))]
    qc = ct((["Linear"], W_FP8B, A_FP8G), ignore=["lm_head"])
    plan = read_compressed_tensors(qc).plan
    assert plan is not None
    (difference,) = model_differences(qc, plan, shapes)
    assert "in_proj_ba" in difference and r"re:.*linear_attn\.in_proj_(ba|a|b)$" in difference
    with pytest.raises(ConfigNotHonoured, match="in_proj_ba"):
        resolve(DispatchInput(engine="vllm", config_file=qc), shapes)
    fixed = ct((["Linear"], W_FP8B, A_FP8G), ignore=["lm_head", r"re:.*linear_attn\.in_proj_(ba|a|b)$"])
    assert resolve(DispatchInput(engine="vllm", config_file=fixed), shapes).as_written
    # rollout.quantization.ignore reaches the engine appended to the config's list: no difference
    ignored = resolve(DispatchInput(engine="vllm", config_file=qc, ignore=("in_proj_ba",)), shapes)
    assert ignored.as_written
