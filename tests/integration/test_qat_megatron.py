"""Reference QAT on a real Megatron-Core GPTModel (CPU): trains on dequantize(exported tensors).

The model has grouped-query attention (linear_qkv interleaves q/k/v per query group) and a gated
MLP (linear_fc1 = [gate; up]). The weights each parallel linear computes with are split into
Hugging Face tensors with the exporter's own functions and compared, bit for bit, with the
decoded checkpoint tensors the exporter makes from the Megatron model.
"""

from __future__ import annotations

import pytest
import torch

from tests.megatron_cpu import causal_mask, megatron_cpu_env, tiny_gpt_model  # noqa: F401
from tests.unit.qat_models import rollout_values

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("megatron_cpu_env")]

CONFIG = dict(hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
              gated_linear_unit=True, add_bias_linear=False, tied=False, vocab_size=64)


def _model() -> torch.nn.Module:
    from functools import partial

    from megatron.core.models.gpt.gpt_model import GPTModel

    # Rotary positions: a learned position table has no Hugging Face Linear counterpart.
    return tiny_gpt_model(model_cls=partial(GPTModel, position_embedding_type="rope"), **CONFIG).bfloat16()


def _record_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    seen: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if hasattr(module, "_forward_impl"):
            inner = module._forward_impl

            def record(*args, _name=name, _inner=inner, **kwargs):  # type: ignore[no-untyped-def]
                seen[f"{_name}.weight"] = kwargs["weight"].detach().clone()
                return _inner(*args, **kwargs)

            module._forward_impl = record
    return seen


def _forward(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    return model(ids, torch.arange(8).expand_as(ids), causal_mask(8))


def _split_to_hf(model: torch.nn.Module, name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    from adapters.megatron.hf_names import hf_named_weights

    class One:
        config = model.config

        @staticmethod
        def state_dict(keep_vars: bool = False) -> dict[str, torch.Tensor]:
            return {name: weight}

    return dict(hf_named_weights(One()))  # type: ignore[arg-type]


@pytest.mark.parametrize("preset", ["FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4"])
def test_megatron_linears_compute_with_the_exported_values(preset: str) -> None:
    from adapters.megatron.hf_names import hf_named_weights
    from adapters.qat_reference.backend import ReferenceQatBackend
    from domain.quant.plan import QuantizationPlan

    model = _model()
    plan = QuantizationPlan.from_presets(preset, None)
    want = rollout_values(plan, list(hf_named_weights(model)))
    summary = ReferenceQatBackend().apply(model, plan)
    assert summary.tensors[0].name.startswith("decoder.layers.0.")
    seen = _record_weights(model)
    _forward(model)
    quantized = {p.name for p in summary.quantized}
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in quantized
    assert "output_layer.weight" not in quantized  # lm_head stays BF16
    checked = 0
    for name, weight in seen.items():
        for hf, value in _split_to_hf(model, name, weight).items():
            assert torch.equal(value.view(torch.int16), want[hf].view(torch.int16)), hf
            checked += 1
    assert checked == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and lm_head


def test_megatron_inputs_are_fake_quantized_and_gradients_flow() -> None:
    from adapters.qat_reference.backend import ReferenceQatBackend
    from domain.quant.codecs import fake_quantize_activation
    from domain.quant.formats import ActivationScheme
    from domain.quant.plan import QuantizationPlan

    model = _model()
    model.train()
    layer = model.decoder.layers[0]
    got: dict[str, torch.Tensor] = {}
    inner = layer.self_attention.linear_qkv._forward_impl

    def record(*args, **kwargs):  # type: ignore[no-untyped-def]
        got["input"] = kwargs["input"].detach().clone()
        return inner(*args, **kwargs)

    layer.self_attention.linear_qkv._forward_impl = record
    norm_out: dict[str, torch.Tensor] = {}
    layer.input_layernorm.register_forward_hook(lambda m, a, out: norm_out.setdefault("x", out.detach().clone()))
    ReferenceQatBackend().apply(model, QuantizationPlan.from_presets("NVFP4", None))
    _forward(model).float().square().mean().backward()
    want = fake_quantize_activation(ActivationScheme.NVFP4_PER_TOKEN, norm_out["x"])
    assert torch.equal(got["input"], want)
    assert not torch.equal(got["input"], norm_out["x"])
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and bool(g.abs().sum() > 0) for n, g in grads.items() if "linear" in n), grads.keys()


def test_gradient_accumulation_fusion_is_rejected_by_name() -> None:
    from adapters.qat_reference.backend import ReferenceQatBackend
    from domain.errors import QatUnsupportedModel
    from domain.quant.plan import QuantizationPlan

    model = _model()
    model.config.gradient_accumulation_fusion = True
    with pytest.raises(QatUnsupportedModel, match="gradient_accumulation_fusion"):
        ReferenceQatBackend().apply(model, QuantizationPlan.from_presets("FP8_BLOCK", None))


def test_megatron_moe_experts_compute_with_the_exported_values() -> None:
    """Routed and shared experts of a Megatron MoE layer: each expert's linears, called directly
    (Megatron's token dispatch needs CUDA), compute with the decoded NVFP4 / FP8 block tensors."""
    from adapters.megatron.hf_names import hf_named_weights
    from adapters.qat_reference.backend import ReferenceQatBackend
    from domain.quant.plan import QuantizationPlan

    model = tiny_gpt_model(
        **{**CONFIG, "num_layers": 1}, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64,
        moe_shared_expert_intermediate_size=64, moe_token_dispatcher_type="allgather",
    ).bfloat16()
    plan = QuantizationPlan.from_presets("FP8_BLOCK", "NVFP4")
    want = rollout_values(plan, list(hf_named_weights(model)))
    summary = ReferenceQatBackend().apply(model, plan)
    quantized = {p.name for p in summary.quantized}
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight" in quantized
    assert "decoder.layers.0.mlp.router.weight" not in quantized  # the router stays BF16
    seen = _record_weights(model)
    mlp = model.decoder.layers[0].mlp
    x = torch.randn(6, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        for expert in [*mlp.experts.local_experts, mlp.shared_experts]:
            expert.linear_fc1(x)
            expert.linear_fc2(torch.randn(6, 64, dtype=torch.bfloat16))
    checked = 0
    for name, weight in seen.items():
        for hf, value in _split_to_hf(model, name, weight).items():
            assert torch.equal(value.view(torch.int16), want[hf].view(torch.int16)), hf
            checked += 1
    assert checked == 5 * 3  # gate, up, down of four routed experts and the shared expert
