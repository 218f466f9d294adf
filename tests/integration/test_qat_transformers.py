"""Reference QAT on a real transformers Qwen3-MoE (fused 3-D experts, separate q/k/v and gate/up).

Weight-only plans: the QAT forward equals, bit for bit, the forward of a copy of the model whose
weights were replaced by dequantize(exported tensors). With activation schemes: every expert
input reaches F.linear and is fake-quantized (the eager experts implementation).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (the `test` extra)")

from adapters.qat_reference.backend import ReferenceQatBackend  # noqa: E402
from domain.quant.plan import QuantizationPlan  # noqa: E402
from tests.unit.qat_models import rollout_values  # noqa: E402


def _model(experts_implementation: str = "eager") -> torch.nn.Module:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        mlp_only_layers=[0], tie_word_embeddings=False, experts_implementation=experts_implementation,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05)
    return model


IDS = torch.arange(24).reshape(2, 12) % 64


@pytest.mark.parametrize(("linear", "moe"), [("FP8_BLOCK", "NVFP4"), ("MXFP8", "MXFP4")])
def test_weight_only_qat_equals_the_model_with_exported_weights(linear: str, moe: str) -> None:
    model = _model()
    plan = QuantizationPlan.from_presets(linear, moe, linear_activation="none", moe_activation="none")
    served = copy.deepcopy(model)
    values = rollout_values(plan, [(n, p.detach()) for n, p in model.named_parameters()])
    served.load_state_dict(values, strict=False)
    summary = ReferenceQatBackend().apply(model, plan)
    assert "model.layers.1.mlp.experts.gate_up_proj" in {p.name for p in summary.quantized}
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, served(IDS).logits)


def test_expert_activations_are_fake_quantized_in_the_eager_implementation() -> None:
    model = _model()
    with torch.no_grad():
        weight_only = copy.deepcopy(model)
        ReferenceQatBackend().apply(weight_only, QuantizationPlan.from_presets(None, "NVFP4", moe_activation="none"))
        ReferenceQatBackend().apply(model, QuantizationPlan.from_presets(None, "NVFP4"))
        a, b = model(IDS).logits, weight_only(IDS).logits
    assert not torch.equal(a, b)
    assert torch.isfinite(a).all()


def test_a_fused_experts_kernel_that_bypasses_f_linear_is_reported_by_name() -> None:
    from domain.errors import QatUnsupportedModel

    model = _model(experts_implementation="grouped_mm")
    ReferenceQatBackend().apply(model, QuantizationPlan.from_presets(None, "MXFP8"))
    with torch.no_grad(), pytest.raises(QatUnsupportedModel, match=r"model\.layers\.1\.mlp\.experts.*eager"):
        model(IDS)
