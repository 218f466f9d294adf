"""MegatronTrainerModel.named_weights: Hugging Face names, q/k/v and gate/up split like Megatron."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (the `megatron` extra)")

from adapters.megatron.trainer_model import MegatronTrainerModel
from app.bootstrap import bootstrap
from app.services.logprob import LogProbService
from domain.forward.mode import FusedForwardMode
from tests.megatron_cpu import megatron_cpu_env, tiny_gpt_model  # noqa: F401

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("megatron_cpu_env")]

def build_logprob_service(model, fused_forward=None, *, environ=None, **kwargs):  # type: ignore[no-untyped-def]
    """The composition root's LogProbService for `model`, with actor.fused_forward set."""
    cfg = {"actor": {"fused_forward": fused_forward}} if fused_forward is not None else None
    return bootstrap(cfg, environ=environ).trainer_side.logprob_service(model, **kwargs)



def _model(tied: bool):
    return tiny_gpt_model(tied=tied, num_layers=1, num_query_groups=2, gated_linear_unit=True)


def test_names_in_layer_order_and_lm_head_only_when_untied():
    names = [n for n, _ in MegatronTrainerModel.build(_model(False), FusedForwardMode.HOOK).named_weights()]
    assert names[0] == "model.embed_tokens.weight"
    assert names[-1] == "lm_head.weight"
    for leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"model.layers.0.self_attn.{leaf}.weight" in names
    for leaf in ("gate_proj", "up_proj", "down_proj"):
        assert f"model.layers.0.mlp.{leaf}.weight" in names
    assert "model.layers.0.post_attention_layernorm.weight" in names and "model.norm.weight" in names
    tied = [n for n, _ in MegatronTrainerModel.build(_model(True), FusedForwardMode.HOOK).named_weights()]
    assert "lm_head.weight" not in tied and len(tied) == len(names) - 1


def test_qkv_and_gate_up_split_agree_with_megatron_modules():
    model = _model(False)
    weights = dict(MegatronTrainerModel.build(model, FusedForwardMode.HOOK).named_weights())
    cfg = model.config
    heads, groups, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    x = torch.randn(5, 2, cfg.hidden_size)
    attn = model.decoder.layers[0].self_attention
    with torch.no_grad():
        q, k, v = attn.get_query_key_value_tensors(x, None)[:3]
        p = "model.layers.0.self_attn."
        for got, name, n in ((q, "q_proj", heads), (k, "k_proj", groups), (v, "v_proj", groups)):
            mine = x @ weights[p + name + ".weight"].T + weights[p + name + ".bias"]
            torch.testing.assert_close(mine.reshape(5, 2, n, d), got.reshape(5, 2, n, d))
        fc1, bias = model.decoder.layers[0].mlp.linear_fc1(x)
        fc1 = fc1 + bias if bias is not None else fc1
        gate, up = torch.chunk(fc1, 2, dim=-1)  # Megatron's GLU: activation(first) * second
        p = "model.layers.0.mlp."
        torch.testing.assert_close(x @ weights[p + "gate_proj.weight"].T + weights[p + "gate_proj.bias"], gate)
        torch.testing.assert_close(x @ weights[p + "up_proj.weight"].T + weights[p + "up_proj.bias"], up)


def test_service_over_megatron_and_over_a_ready_trainer_model():
    model = _model(True)
    service = build_logprob_service(model, "legacy", environ={})
    ids = torch.randint(0, 64, (3, 7))
    scores = service.compute(ids, temperature=1.0)
    assert scores.log_probs.shape == (3, 6) and not scores.log_probs.requires_grad
    assert scores.mean_entropy() > 0
    graded = service.compute(ids, temperature=1.0, with_grad=True)
    assert graded.log_probs.requires_grad
    # An object that already is a TrainerModel is used as is (no fused-forward decision).
    wrapped = build_logprob_service(service.trainer, None, environ={})
    assert isinstance(wrapped, LogProbService) and wrapped.mode == "none"
    assert torch.equal(wrapped.compute(ids).log_probs, scores.log_probs)
