"""The embedded reference model: its forward against transformers' Qwen3 / Qwen3-MoE, its naming,
and the engine layout against the codecs' real outputs."""

from __future__ import annotations

import attrs
import pytest
import torch

from adapters.reference.config import MICRO_MOE, hf_weight_shapes, preset
from adapters.reference.layout import EngineLayout, tensor_specs
from adapters.reference.model import forward_logits
from adapters.reference.trainer import ReferenceTrainer, init_weights
from domain.errors import EngineTensorMismatch
from domain.quant.codecs import quantize_weight
from domain.quant.formats import FORMATS
from domain.quant.plan import QuantizationPlan
from domain.quant.stream import quantize_stream
from tests import refit_support as rs
from tests.refit_support import one_thread  # noqa: F401  (autouse fixture)

MICRO_DENSE = attrs.evolve(MICRO_MOE, num_experts=0, moe_intermediate_size=0, mlp_only_layers=())


def _hf_model(transformers, cfg):
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=False, attention_bias=False,
    )
    if not cfg.is_moe:
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common)).eval()
    hc = transformers.Qwen3MoeConfig(
        **common, num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size, mlp_only_layers=list(cfg.mlp_only_layers),
        norm_topk_prob=True, decoder_sparse_step=1,
    )
    return transformers.Qwen3MoeForCausalLM(hc).eval()


@pytest.mark.parametrize("cfg", [MICRO_DENSE, MICRO_MOE], ids=["dense", "moe"])
def test_forward_matches_transformers_qwen3(cfg):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    w = init_weights(cfg, 0, torch.float32)
    model = _hf_model(transformers, cfg)
    sd = {n: v for n, v in ReferenceTrainer(cfg, w).named_weights() if ".experts." not in n}
    for i in range(cfg.num_layers):
        if cfg.is_moe_layer(i):  # transformers 5 keeps experts fused in 3-D, gate rows first
            sd[f"model.layers.{i}.mlp.experts.gate_up_proj"] = w[f"layers.{i}.w13"]
            sd[f"model.layers.{i}.mlp.experts.down_proj"] = w[f"layers.{i}.w2"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected
    ids = rs.token_ids(cfg, batch=2, seq=16)
    with torch.no_grad():
        ref = model(ids).logits
    ours = forward_logits(cfg, w, ids)
    assert torch.allclose(ours, ref, atol=2e-5, rtol=1e-5), (ours - ref).abs().max()


def test_named_weights_are_views_in_layer_order_with_hf_shapes():
    t = ReferenceTrainer.from_seed(MICRO_MOE)
    named = list(t.named_weights())
    assert [(n, tuple(v.shape)) for n, v in named] == hf_weight_shapes(MICRO_MOE)
    storages = {v.untyped_storage().data_ptr() for v in t.weights.values()}
    assert all(v.untyped_storage().data_ptr() in storages for _, v in named)  # views, no copies
    assert sum(v.numel() for _, v in named) == MICRO_MOE.num_parameters() == sum(v.numel() for v in t.weights.values())


def test_seeded_weights_are_reproducible_and_perturbation_moves_them():
    a, b = ReferenceTrainer.from_seed(MICRO_MOE, 3), ReferenceTrainer.from_seed(MICRO_MOE, 3)
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    b.perturb_(seed=1, scale=0.01)
    assert not any(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)


@pytest.mark.parametrize("name", [n for n, f in FORMATS.items() if f.is_quantized])
def test_tensor_specs_match_what_the_codecs_produce(name):
    fmt = FORMATS[name]
    for shape in ((256, 128), (3, 128, 64)):
        q = quantize_weight(fmt, torch.randn(shape).to(torch.bfloat16))
        assert {k: (tuple(v.shape), v.dtype) for k, v in q.tensors.items()} == tensor_specs(fmt, shape)


def test_engine_layout_expects_exactly_the_exported_stream():
    for plan in (rs.DEFAULT_PLAN, QuantizationPlan.bf16(), QuantizationPlan.from_presets("MXFP4", "MXFP8")):
        layout = EngineLayout.build(MICRO_MOE, plan)
        named = list(quantize_stream(plan, ReferenceTrainer.from_seed(MICRO_MOE).named_weights()))
        assert [n for n, _ in named] == list(layout.targets)
        for n, t in named:
            assert (tuple(t.shape), t.dtype) == (layout.targets[n].shape, layout.targets[n].dtype), n


def test_a_partly_ignored_fused_module_is_rejected():
    plan = QuantizationPlan.from_presets("FP8_BLOCK", None, ignore=["re:.*q_proj$"])
    with pytest.raises(EngineTensorMismatch, match=r"fused module layers\.0\.qkv"):
        EngineLayout.build(MICRO_MOE, plan)


def test_fp8_blocks_that_would_straddle_fused_shards_are_rejected():
    cfg = attrs.evolve(MICRO_MOE, num_heads=1, num_kv_heads=1)  # q/k/v of 64 rows: block 128 straddles
    with pytest.raises(EngineTensorMismatch, match="not a multiple of the FP8_BLOCK block"):
        EngineLayout.build(cfg, QuantizationPlan.from_presets("FP8_BLOCK", None))
    EngineLayout.build(cfg, QuantizationPlan.from_presets("MXFP8", None))  # blocks along K only: fine


def test_unknown_preset_and_bad_config_are_rejected():
    with pytest.raises(KeyError, match="valid: tiny-moe"):
        preset("huge")
    with pytest.raises(ValueError, match="num_heads must be a multiple"):
        attrs.evolve(MICRO_MOE, num_heads=3)


def test_perturbation_does_not_depend_on_the_thread_count():
    """Ranks of a distributed refit run with one intra-op thread, a test process with more: a
    training-like step must give the same bits in both."""
    def perturbed(threads: int) -> dict[str, torch.Tensor]:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            t = ReferenceTrainer.from_seed(preset("tiny-moe"), 0)
            for step in range(3):
                t.perturb_(step)
            return rs.bits(dict(t.named_weights()))
        finally:
            torch.set_num_threads(before)

    assert rs.same_bits(perturbed(1), perturbed(2))
