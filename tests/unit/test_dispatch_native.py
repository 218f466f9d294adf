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
