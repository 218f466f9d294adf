"""Megatron-Core MoE layers -> Hugging Face names: routed experts, the router, shared experts and
their gate, split like Megatron computes them; the quantization plan and the exporter on top."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (the `megatron` extra)")

from adapters.megatron import trainer_model as tm
from adapters.megatron.hf_names import hf_named_weights
from adapters.megatron.trainer_model import MegatronTrainerModel
from domain.errors import MegatronModelUnsupported
from domain.forward.mode import FusedForwardMode
from domain.quant.plan import QuantizationPlan
from domain.quant.stream import quantize_stream
from tests.megatron_cpu import megatron_cpu_env, tiny_gpt_model  # noqa: F401

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("megatron_cpu_env")]
EXPERTS = 4


def _moe_model():
    return tiny_gpt_model(
        tied=False, num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=EXPERTS, moe_router_topk=2,
        moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True,
        gated_linear_unit=True, add_bias_linear=False, moe_token_dispatcher_type="allgather",
    )


def test_every_moe_parameter_gets_its_hugging_face_name():
    model = _moe_model()
    names = [n for n, _ in MegatronTrainerModel.build(model, FusedForwardMode.HOOK).named_weights()]
    assert len(names) == len(set(names))
    for layer in (0, 1):
        p = f"model.layers.{layer}.mlp."
        assert p + "gate.weight" in names and p + "shared_expert_gate.weight" in names
        for leaf in ("gate_proj", "up_proj", "down_proj"):
            assert p + f"shared_expert.{leaf}.weight" in names
            assert [n for n in names if n.startswith(p + "experts.") and n.endswith(f".{leaf}.weight")] == [
                p + f"experts.{e}.{leaf}.weight" for e in range(EXPERTS)
            ]


def test_expert_and_shared_expert_splits_agree_with_megatron_modules():
    model = _moe_model()
    weights = dict(MegatronTrainerModel.build(model, FusedForwardMode.HOOK).named_weights())
    x = torch.randn(5, 64)
    mlp = model.decoder.layers[1].mlp
    p = "model.layers.1.mlp."
    with torch.no_grad():
        for e, expert in enumerate(mlp.experts.local_experts):
            gate, up = expert.linear_fc1(x)[0].chunk(2, dim=-1)  # Megatron's GLU: act(first) * second
            torch.testing.assert_close(x @ weights[p + f"experts.{e}.gate_proj.weight"].T, gate)
            torch.testing.assert_close(x @ weights[p + f"experts.{e}.up_proj.weight"].T, up)
            h = torch.randn(5, 32)
            torch.testing.assert_close(h @ weights[p + f"experts.{e}.down_proj.weight"].T, expert.linear_fc2(h)[0])
        gate, up = mlp.shared_experts.linear_fc1(x)[0].chunk(2, dim=-1)
        torch.testing.assert_close(x @ weights[p + "shared_expert.gate_proj.weight"].T, gate)
        torch.testing.assert_close(x @ weights[p + "shared_expert.up_proj.weight"].T, up)
        torch.testing.assert_close(x @ weights[p + "gate.weight"].T, x @ mlp.router.weight.T)
        assert torch.equal(weights[p + "shared_expert_gate.weight"], mlp.shared_experts.gate_weight)


def test_the_plan_quantizes_experts_and_shared_experts_and_keeps_routers_in_bf16():
    model = _moe_model()
    named = list(MegatronTrainerModel.build(model, FusedForwardMode.HOOK).named_weights())
    plan = QuantizationPlan.from_presets(linear="FP8_BLOCK", moe="NVFP4")
    out = dict(quantize_stream(plan, ((n, t.to(torch.bfloat16)) for n, t in named)))
    p = "model.layers.0.mlp."
    assert out[p + "gate.weight"].dtype == torch.bfloat16 and out[p + "shared_expert_gate.weight"].dtype == torch.bfloat16
    assert out[p + "experts.2.gate_proj.weight_packed"].dtype == torch.uint8  # NVFP4
    # gate and up are one fused group: one global scale for both
    assert torch.equal(out[p + "experts.2.gate_proj.weight_global_scale"], out[p + "experts.2.up_proj.weight_global_scale"])
    assert out[p + "shared_expert.down_proj.weight"].dtype == torch.float8_e4m3fn  # FP8_BLOCK


class _GroupedStandIn:
    """A state dict shaped like Transformer Engine's grouped experts (`linear_fc1.weightE`)."""

    def __init__(self, sequential: torch.nn.Module) -> None:
        self.config = sequential.config
        sd = {}
        for name, t in sequential.state_dict().items():
            if name.endswith("_extra_state"):
                continue
            parts = name.split(".")
            if "local_experts" in parts:
                i = parts.index("local_experts")
                expert, fc, kind = parts[i + 1], parts[i + 2], parts[i + 3]
                name = ".".join([*parts[:i], fc, f"{kind}{expert}"])
            sd[name] = t
        self._sd = sd

    def state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        return dict(self._sd)


def test_grouped_expert_names_map_to_the_same_tensors():
    model = _moe_model()
    sequential = dict(hf_named_weights(model))
    grouped = dict(hf_named_weights(_GroupedStandIn(model)))  # type: ignore[arg-type]
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight3" in _GroupedStandIn(model).state_dict()
    assert grouped.keys() == sequential.keys()
    assert all(torch.equal(grouped[n], sequential[n]) for n in sequential)


def test_expert_parallel_models_are_rejected_with_the_reason(monkeypatch):
    model = _moe_model()
    monkeypatch.setattr(tm, "_parallel_size", lambda name: 2 if name == "expert_model_parallel" else 1)
    with pytest.raises(MegatronModelUnsupported, match="expert_model_parallel > 1"):
        list(MegatronTrainerModel.build(model, FusedForwardMode.HOOK).named_weights())


def test_reference_qat_layout_names_every_expert_row():
    from adapters.qat_reference.layouts import MegatronLayout

    model = _moe_model()
    tensors = {t.name: t for t in MegatronLayout().tensors(model)}
    fc1 = tensors["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]
    assert [part.name for part in fc1.parts] == [
        "model.layers.0.mlp.experts.1.gate_proj.weight", "model.layers.0.mlp.experts.1.up_proj.weight"
    ]
    assert [part.index for part in fc1.parts] == [(slice(0, 32),), (slice(32, 64),)]


def test_the_router_expert_bias_is_deepseeks_score_correction_bias_and_stays_bf16():
    model = tiny_gpt_model(
        tied=False, num_layers=1, hidden_size=64, num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=32,
        gated_linear_unit=True, add_bias_linear=False, moe_token_dispatcher_type="allgather",
        moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
    )
    weights = dict(hf_named_weights(model))
    bias = weights["model.layers.0.mlp.gate.e_score_correction_bias"]
    assert torch.equal(bias, model.decoder.layers[0].mlp.router.expert_bias)
    plan = QuantizationPlan.from_presets(linear="FP8_BLOCK", moe="NVFP4")
    assert not plan.decide("model.layers.0.mlp.gate.e_score_correction_bias", tuple(bias.shape)).is_quantized
