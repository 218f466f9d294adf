"""Megatron -> Hugging Face names of a Qwen3.5-style hybrid, built with megatron-core's own
GatedDeltaNet spec on CPU: GDN (`linear_attn.*`), gated attention, routed and shared experts, MTP.

transformers 5.x has the architecture (Qwen3_5MoeForCausalLM): the export is saved as a
checkpoint and loaded there, strictly (no missing, unexpected or mismatched tensor), and every
tensor arrives unchanged. transformers drops `mtp.*` on load (its `_keys_to_ignore_on_load_
unexpected`), so the MTP names are compared with a table written from the Hugging Face checkpoint
layout of Qwen3.5's MTP block (vLLM's Qwen3-Next/Qwen3.5 MTP module reads the same names). The
splits of Megatron's fused projections are checked against Megatron's own modules.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (the `megatron` extra)")
pytest.importorskip("fla", reason="megatron-core's GatedDeltaNet needs flash-linear-attention")
transformers = pytest.importorskip("transformers", reason="the export is loaded into transformers' Qwen3.5-MoE")

from adapters.megatron.hf_names import hf_named_weights  # noqa: E402
from domain.quant.plan import QuantizationPlan  # noqa: E402
from tests.megatron_cpu import HYBRID, HYBRID_VOCAB, megatron_cpu, tiny_hybrid_model  # noqa: E402

pytestmark = pytest.mark.megatron

# The MTP block of a Qwen3.5 checkpoint (one MTP layer, here an attention + MoE layer).
MTP_NAMES = {
    "mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
    "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.post_attention_layernorm.weight",
    *(f"mtp.layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")),
    "mtp.layers.0.mlp.gate.weight", "mtp.layers.0.mlp.shared_expert_gate.weight",
    *(f"mtp.layers.0.mlp.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")),
    *(f"mtp.layers.0.mlp.experts.{e}.{p}.weight" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")),
}


@pytest.fixture(scope="module")
def hybrid():
    with megatron_cpu(), torch.compiler.set_stance("force_eager"):
        model = tiny_hybrid_model()
        yield model, {n: t.detach().clone().contiguous() for n, t in hf_named_weights(model)}


def _hf_config():
    return transformers.Qwen3_5MoeTextConfig(
        vocab_size=HYBRID_VOCAB, hidden_size=HYBRID["hidden_size"], num_hidden_layers=HYBRID["num_layers"],
        num_attention_heads=HYBRID["num_attention_heads"], num_key_value_heads=HYBRID["num_query_groups"],
        head_dim=HYBRID["kv_channels"], linear_conv_kernel_dim=HYBRID["linear_conv_kernel_dim"],
        linear_key_head_dim=HYBRID["linear_key_head_dim"], linear_value_head_dim=HYBRID["linear_value_head_dim"],
        linear_num_key_heads=HYBRID["linear_num_key_heads"], linear_num_value_heads=HYBRID["linear_num_value_heads"],
        moe_intermediate_size=HYBRID["moe_ffn_hidden_size"],
        shared_expert_intermediate_size=HYBRID["moe_shared_expert_intermediate_size"],
        num_experts=HYBRID["num_moe_experts"], num_experts_per_tok=HYBRID["moe_router_topk"],
        layer_types=["linear_attention"] * 3 + ["full_attention"], tie_word_embeddings=False,
    )


def test_the_export_loads_strictly_into_transformers_qwen3_5_moe(hybrid, tmp_path) -> None:
    from safetensors.torch import save_file

    _, weights = hybrid
    config = _hf_config()
    config.architectures = ["Qwen3_5MoeForCausalLM"]
    config.save_pretrained(tmp_path)
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model, info = transformers.Qwen3_5MoeForCausalLM.from_pretrained(tmp_path, output_loading_info=True,
                                                                    dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    loaded = model.state_dict()
    for name, t in weights.items():
        if name.startswith("mtp."):
            continue
        if ".mlp.experts." in name:  # transformers fuses the experts on load: [gate; up] per expert, then down
            layer, e, proj = name.split(".mlp.experts.")[0], int(name.split(".")[5]), name.split(".")[6]
            fused = loaded[f"{layer}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"][e]
            rows = t.shape[0]
            part = fused if proj == "down_proj" else fused[:rows] if proj == "gate_proj" else fused[rows:]
            assert torch.equal(part, t), name
        else:
            assert torch.equal(loaded[name], t), name


def test_gdn_attention_and_mtp_names(hybrid) -> None:
    _, weights = hybrid
    for layer in (0, 1, 2):
        p = f"model.layers.{layer}.linear_attn."
        for leaf in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
                     "conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight"):
            assert p + leaf in weights, p + leaf
        assert f"model.layers.{layer}.self_attn.q_proj.weight" not in weights
    heads, d = HYBRID["num_attention_heads"], HYBRID["kv_channels"]
    assert weights["model.layers.3.self_attn.q_proj.weight"].shape == (2 * heads * d, HYBRID["hidden_size"])
    assert {n for n in weights if n.startswith("mtp.")} == MTP_NAMES


def test_fused_splits_agree_with_megatrons_modules(hybrid) -> None:
    model, weights = hybrid
    x = torch.randn(5, 1, HYBRID["hidden_size"])
    with torch.no_grad():
        gdn = model.decoder.layers[0].self_attention
        q, k, v, z, b, a = torch.split(gdn.in_proj(x)[0], list(gdn.in_proj_split_sections), dim=-1)
        p = "model.layers.0.linear_attn."
        torch.testing.assert_close(x @ weights[p + "in_proj_qkv.weight"].T, torch.cat([q, k, v], dim=-1))
        for name, want in (("in_proj_z", z), ("in_proj_b", b), ("in_proj_a", a)):
            torch.testing.assert_close(x @ weights[p + f"{name}.weight"].T, want)
        attn = model.decoder.layers[3].self_attention
        query, key, value, gate = attn.get_query_key_value_tensors(x, None, output_gate=True)
        d = HYBRID["kv_channels"]
        # Qwen3.5's q_proj: per head [query; gate] (transformers chunks each head's 2*d outputs in two)
        mine_q, mine_gate = torch.chunk((x @ weights["model.layers.3.self_attn.q_proj.weight"].T).view(5, 1, -1, 2 * d), 2, -1)
        torch.testing.assert_close(mine_gate.reshape(gate.shape), gate)
        q_norm = attn.q_layernorm(mine_q)  # Megatron returns the normed query
        torch.testing.assert_close(q_norm.reshape(query.shape), query)
        torch.testing.assert_close(attn.k_layernorm((x @ weights["model.layers.3.self_attn.k_proj.weight"].T).view(key.shape)), key)
        torch.testing.assert_close((x @ weights["model.layers.3.self_attn.v_proj.weight"].T).view(value.shape), value)


def test_the_plans_gdn_rules_apply_to_the_export(hybrid) -> None:
    _, weights = hybrid
    plan = QuantizationPlan.from_presets(linear="FP8_BLOCK", moe="NVFP4")
    decide = {n: plan.decide(n, tuple(t.shape)) for n, t in weights.items()}
    for leaf in ("in_proj_b", "in_proj_a"):  # the seeds' rule: GDN's b/a projections stay BF16
        assert not decide[f"model.layers.1.linear_attn.{leaf}.weight"].is_quantized
    assert decide["model.layers.1.linear_attn.in_proj_qkv.weight"].format.name == "FP8_BLOCK"
    assert decide["model.layers.1.linear_attn.out_proj.weight"].format.name == "FP8_BLOCK"
    assert not decide["model.layers.1.linear_attn.conv1d.weight"].is_quantized  # a convolution
    assert decide["mtp.layers.0.mlp.experts.1.up_proj.weight"].format.name == "NVFP4"
    assert not decide["mtp.layers.0.mlp.gate.weight"].is_quantized
