"""quantize_stream: order, fused-group global scales, 3-D experts, specs, streaming memory bound."""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import pytest
import torch

from domain.errors import NonDivisibleTensors
from domain.quant.codecs import quantize_weight
from domain.quant.formats import F4E2M1_MAX, F8E4M3_MAX, FORMATS, NVFP4
from domain.quant.plan import QuantizationPlan
from domain.quant.stream import checkpoint_specs, quantize_stream

L0 = "model.layers.0"


def _layer(i: int, *, experts: int = 0) -> list[tuple[str, torch.Tensor]]:
    p = f"model.layers.{i}"
    out = [
        (f"{p}.input_layernorm.weight", torch.ones(64)),
        (f"{p}.self_attn.q_proj.weight", torch.randn(64, 64)),
        (f"{p}.self_attn.k_proj.weight", torch.randn(32, 64) * 3),
        (f"{p}.self_attn.o_proj.weight", torch.randn(64, 64)),
        (f"{p}.self_attn.v_proj.weight", torch.randn(32, 64) * 0.5),
    ]
    if experts:
        out.append((f"{p}.mlp.gate.weight", torch.randn(experts, 64)))
        for e in range(experts):
            out += [(f"{p}.mlp.experts.{e}.{n}_proj.weight", torch.randn(*s) * (e + 1))
                    for n, s in (("gate", (32, 64)), ("up", (32, 64)), ("down", (64, 32)))]
    else:
        out += [(f"{p}.mlp.gate_proj.weight", torch.randn(128, 64)), (f"{p}.mlp.up_proj.weight", torch.randn(128, 64) * 2),
                (f"{p}.mlp.down_proj.weight", torch.randn(64, 128))]
    return out


def _model(*, experts: int = 0, layers: int = 2) -> list[tuple[str, torch.Tensor]]:
    head = [("model.embed_tokens.weight", torch.randn(128, 64))]
    tail = [("model.norm.weight", torch.ones(64)), ("lm_head.weight", torch.randn(128, 64))]
    return head + [t for i in range(layers) for t in _layer(i, experts=experts)] + tail


def test_bf16_plan_passes_every_tensor_through_unchanged() -> None:
    model = _model()
    out = list(quantize_stream(QuantizationPlan.bf16(), model))
    assert [n for n, _ in out] == [n for n, _ in model]
    assert all(a is b for (_, a), (_, b) in zip(out, model, strict=True))


def test_group_global_scale_is_computed_over_the_whole_group() -> None:
    model = _model()
    out = dict(quantize_stream(QuantizationPlan.from_presets(linear="NVFP4"), model))
    w = dict(model)
    qkv = [w[f"{L0}.self_attn.{p}_proj.weight"] for p in "qkv"]
    expected = F8E4M3_MAX * F4E2M1_MAX / torch.cat([t.abs().flatten() for t in qkv]).max()  # spec: 448*6/amax
    for p in "qkv":
        gs = out[f"{L0}.self_attn.{p}_proj.weight_global_scale"]
        assert torch.equal(gs, expected.reshape(1).float())
    # o_proj is alone: its scale comes from itself
    o = w[f"{L0}.self_attn.o_proj.weight"]
    assert torch.equal(out[f"{L0}.self_attn.o_proj.weight_global_scale"], (2688.0 / o.abs().max()).reshape(1))
    gate, up = w[f"{L0}.mlp.gate_proj.weight"], w[f"{L0}.mlp.up_proj.weight"]
    gu = 2688.0 / torch.maximum(gate.abs().max(), up.abs().max())
    assert torch.equal(out[f"{L0}.mlp.gate_proj.weight_global_scale"], gu.reshape(1))
    # every quantized tensor is bit-identical to the codec with that shared scale
    ref = quantize_weight(NVFP4, w[f"{L0}.self_attn.k_proj.weight"], global_scale=expected.reshape(1).float())
    for local, t in ref.tensors.items():
        assert torch.equal(out[f"{L0}.self_attn.k_proj.{local}"].view(torch.uint8), t.view(torch.uint8))


def test_output_keeps_layer_order_and_emits_a_group_when_its_last_member_arrives() -> None:
    names = [n for n, _ in quantize_stream(QuantizationPlan.from_presets(linear="NVFP4"), _model())]
    layer_of = [int(n.split(".")[2]) if n.startswith("model.layers.") else None for n in names]
    seen = [x for x in layer_of if x is not None]
    assert seen == sorted(seen)
    # o_proj arrived before v_proj, so it leaves before the q/k/v group
    assert names.index(f"{L0}.self_attn.o_proj.weight_packed") < names.index(f"{L0}.self_attn.q_proj.weight_packed")
    assert names.index(f"{L0}.self_attn.v_proj.weight_packed") < names.index(f"{L0}.mlp.gate_proj.weight_packed")
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"


def test_non_nvfp4_formats_do_not_buffer() -> None:
    names = [n for n, _ in quantize_stream(QuantizationPlan.from_presets(linear="MXFP8"), _model(layers=1))]
    assert names.index(f"{L0}.self_attn.q_proj.weight") < names.index(f"{L0}.self_attn.o_proj.weight")


def test_incomplete_group_is_flushed_when_the_layer_changes() -> None:
    # MLA attention without q_lora: a lone q_proj, no k_proj / v_proj
    model = [(f"model.layers.{i}.self_attn.q_proj.weight", torch.randn(32, 64)) for i in range(2)]
    out = list(quantize_stream(QuantizationPlan.from_presets(linear="NVFP4"), model))
    assert [n for n, _ in out][:3] == [f"{L0}.self_attn.q_proj.{t}" for t in NVFP4.tensor_names]
    assert len(out) == 6
    assert torch.equal(out[2][1], (2688.0 / model[0][1].abs().max()).reshape(1))


def test_fused_3d_experts_equal_the_per_expert_checkpoint() -> None:
    experts = 3
    per_expert = _model(experts=experts, layers=1)
    w = dict(per_expert)
    gate_up = torch.stack([torch.cat([w[f"{L0}.mlp.experts.{e}.gate_proj.weight"], w[f"{L0}.mlp.experts.{e}.up_proj.weight"]])
                           for e in range(experts)])
    down = torch.stack([w[f"{L0}.mlp.experts.{e}.down_proj.weight"] for e in range(experts)])
    fused = [(n, t) for n, t in per_expert if ".experts." not in n]
    fused += [(f"{L0}.mlp.experts.gate_up_proj", gate_up), (f"{L0}.mlp.experts.down_proj", down)]
    for moe in ("NVFP4", "MXFP4", "MXFP8", "FP8_BLOCK"):
        plan = QuantizationPlan.from_presets(moe=moe)
        a = dict(quantize_stream(plan, per_expert))
        b = dict(quantize_stream(plan, fused))
        assert set(a) == set(b)
        for name in a:
            assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), (moe, name)


@pytest.mark.parametrize("linear", ["FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4"])
@pytest.mark.parametrize("scale_name", ["weight_scale", "weight_scale_inv"])
def test_checkpoint_specs_predict_every_output(linear: str, scale_name: str) -> None:
    plan = QuantizationPlan.from_presets(linear=linear, moe="NVFP4", scale_name=scale_name)
    model = [*_model(experts=2, layers=1), (f"{L0}.mlp.experts.gate_up_proj", torch.randn(2, 64, 64))]
    specs = {s.name: s for n, t in model for s in checkpoint_specs(plan, n, tuple(t.shape), t.dtype)}
    out = dict(quantize_stream(plan, model))
    assert set(out) == set(specs)
    for name, t in out.items():
        assert (t.dtype, tuple(t.shape)) == (specs[name].dtype, specs[name].shape), name
    assert any(n.endswith("." + scale_name) for n in out)
    assert not any(n.endswith(".weight_scale_inv" if scale_name == "weight_scale" else ".weight_scale") for n in out)


def test_non_divisible_k_names_the_tensor_and_the_ignore_entry() -> None:
    model = [("model.layers.0.mlp.down_proj.weight", torch.randn(16, 40))]
    with pytest.raises(NonDivisibleTensors, match=r"down_proj.*K=40.*\['re:\.\*\\\.down_proj\$'\]") as err:
        list(quantize_stream(QuantizationPlan.from_presets(linear="MXFP4"), model))
    assert err.value.tensors == ("model.layers.0.mlp.down_proj.weight",)
    plan = QuantizationPlan.from_presets(linear="MXFP4", ignore=err.value.patterns)
    assert [n for n, _ in quantize_stream(plan, model)] == ["model.layers.0.mlp.down_proj.weight"]
    # FP8 block allows partial blocks
    assert len(list(quantize_stream(QuantizationPlan.from_presets(linear="FP8_BLOCK"), model))) == 2


def test_stream_holds_at_most_one_group_of_source_tensors() -> None:
    alive: set[int] = set()
    peak = 0

    def source() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal peak
        for i, (name, t) in enumerate(_model(layers=3)):
            t = t.clone()
            weakref.finalize(t, alive.discard, i)
            alive.add(i)
            peak = max(peak, len(alive))
            yield name, t
            del t

    for _ in quantize_stream(QuantizationPlan.from_presets(linear="NVFP4"), source()):
        pass
    assert 1 <= peak <= 4  # q, k, v held for their shared scale, plus the tensor being read


def test_every_preset_round_trips_through_the_stream() -> None:
    for fmt in FORMATS.values():
        if fmt.is_quantized:
            out = dict(quantize_stream(QuantizationPlan(linear=fmt), _model(layers=1)))
            assert f"{L0}.mlp.down_proj.{fmt.weight_name}" in out
