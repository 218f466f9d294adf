"""domain.refit.shard_map and split_rules on a Qwen3.5-style hybrid (GatedDeltaNet and gated-attention layers,
routed and shared experts, an MTP layer) and on Megatron's expert-tensor-parallel layouts.

The reference is the single-process export (`quantize_stream` on the full tensors), bit for bit:
every layout's shards, quantized where the layout lets them be and gathered otherwise, must give
the same checkpoint tensors.
"""

from __future__ import annotations

import pytest
import torch

from domain.quant.plan import QuantizationPlan
from domain.quant.stream import quantize_stream
from domain.refit.shard_map import ShardMap, place_tensors
from domain.refit.shard_quant import (
    checkpoint_items,
    concat_shards,
    global_scale_from_amax,
    local_amax,
    quantize_shard,
)
from domain.refit.topology import ParallelLayout

H, V, E, MOE_I, SHARED_I = 128, 256, 4, 128, 128
KD, VD, NV, DV = 128, 256, 4, 64  # GDN: 2 key heads and 4 value heads of 64
HEADS, KV_HEADS, HEAD_DIM = 2, 2, 64


def _moe(p: str) -> list[tuple[str, tuple[int, ...]]]:
    out: list[tuple[str, tuple[int, ...]]] = [(f"{p}.post_attention_layernorm.weight", (H,)), (f"{p}.mlp.gate.weight", (E, H))]
    for e in range(E):
        out += [(f"{p}.mlp.experts.{e}.gate_proj.weight", (MOE_I, H)), (f"{p}.mlp.experts.{e}.up_proj.weight", (MOE_I, H)),
                (f"{p}.mlp.experts.{e}.down_proj.weight", (H, MOE_I))]
    out += [
        (f"{p}.mlp.shared_expert.gate_proj.weight", (SHARED_I, H)), (f"{p}.mlp.shared_expert.up_proj.weight", (SHARED_I, H)),
        (f"{p}.mlp.shared_expert.down_proj.weight", (H, SHARED_I)), (f"{p}.mlp.shared_expert_gate.weight", (1, H)),
    ]
    return out


def _attention(p: str) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (f"{p}.input_layernorm.weight", (H,)),
        (f"{p}.self_attn.q_proj.weight", (2 * HEADS * HEAD_DIM, H)),  # query and output gate, per head
        (f"{p}.self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, H)), (f"{p}.self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, H)),
        (f"{p}.self_attn.o_proj.weight", (H, HEADS * HEAD_DIM)),
        (f"{p}.self_attn.q_norm.weight", (HEAD_DIM,)), (f"{p}.self_attn.k_norm.weight", (HEAD_DIM,)),
    ]


def hybrid_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """HF names of a tiny Qwen3.5-MoE: layers 0-1 GatedDeltaNet, layer 2 attention, one MTP layer."""
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (V, H))]
    for i in (0, 1):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", (H,)),
            (f"{p}.linear_attn.in_proj_qkv.weight", (2 * KD + VD, H)), (f"{p}.linear_attn.in_proj_z.weight", (VD, H)),
            (f"{p}.linear_attn.in_proj_b.weight", (NV, H)), (f"{p}.linear_attn.in_proj_a.weight", (NV, H)),
            (f"{p}.linear_attn.conv1d.weight", (2 * KD + VD, 1, 4)),
            (f"{p}.linear_attn.dt_bias", (NV,)), (f"{p}.linear_attn.A_log", (NV,)),
            (f"{p}.linear_attn.norm.weight", (DV,)), (f"{p}.linear_attn.out_proj.weight", (H, VD)),
        ]
        out += _moe(p)
    out += _attention("model.layers.2") + _moe("model.layers.2") + [("model.norm.weight", (H,))]
    out += [("mtp.fc.weight", (H, 2 * H)), ("mtp.pre_fc_norm_embedding.weight", (H,)),
            ("mtp.pre_fc_norm_hidden.weight", (H,))]
    out += _attention("mtp.layers.0") + _moe("mtp.layers.0") + [("mtp.norm.weight", (H,)), ("lm_head.weight", (V, H))]
    return out


SHAPES = hybrid_shapes()


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {n: (torch.randn(s, generator=g) * 0.05).to(torch.bfloat16) for n, s in SHAPES}


def test_hybrid_placement_on_tensor_and_pipeline_parallel() -> None:
    p = place_tensors(ParallelLayout(tp=2, pp=2), SHAPES)
    qkv = p["model.layers.0.linear_attn.in_proj_qkv.weight"]
    assert (qkv.split_dim, qkv.sections, qkv.holders) == (0, (KD, KD, VD), (0, 1))
    # TP rank 1 holds the second half of q, of k and of v, in that order.
    assert [part[0] for part in qkv.shard_parts(1)] == [slice(64, 128), slice(192, 256), slice(384, 512)]
    conv = p["model.layers.0.linear_attn.conv1d.weight"]
    assert (conv.split_dim, conv.sections, conv.shard_shape(0)) == (0, (KD, KD, VD), (256, 1, 4))
    for name, dim in (("linear_attn.in_proj_z.weight", 0), ("linear_attn.in_proj_b.weight", 0),
                      ("linear_attn.A_log", 0), ("linear_attn.dt_bias", 0), ("linear_attn.out_proj.weight", 1),
                      ("mlp.shared_expert.gate_proj.weight", 0), ("mlp.shared_expert.down_proj.weight", 1)):
        assert p[f"model.layers.1.{name}"].split_dim == dim, name
    for name in ("linear_attn.norm.weight", "mlp.gate.weight", "mlp.shared_expert_gate.weight",
                 "mlp.experts.3.up_proj.weight", "input_layernorm.weight"):
        assert p[f"model.layers.1.{name}"].holders == (0,), name
    # Layers 0-1 on stage 0, layer 2, the final norm, the MTP layer and the head on stage 1.
    assert p["model.layers.2.self_attn.q_proj.weight"].holders == (2, 3)
    assert p["mtp.fc.weight"].holders == (2, 3) and p["mtp.fc.weight"].split_dim == 0
    assert p["mtp.layers.0.self_attn.o_proj.weight"].holders == (2, 3)
    assert p["mtp.layers.0.mlp.experts.0.gate_proj.weight"].holders == (2,)
    assert p["mtp.norm.weight"].holders == (2,) and p["lm_head.weight"].holders == (2, 3)


def test_experts_follow_their_expert_group() -> None:
    carved = place_tensors(ParallelLayout(tp=2, ep=2), SHAPES)  # etp=1: ep carved out of the TP ranks
    assert carved["model.layers.0.mlp.experts.1.gate_proj.weight"].holders == (0,)
    assert carved["model.layers.0.mlp.experts.2.gate_proj.weight"].holders == (1,)
    assert carved["model.layers.0.mlp.shared_expert.up_proj.weight"].holders == (0, 1)
    split = place_tensors(ParallelLayout(tp=2, ep=2, etp=2), SHAPES)
    gate, down = split["model.layers.0.mlp.experts.3.gate_proj.weight"], split["model.layers.0.mlp.experts.3.down_proj.weight"]
    assert (gate.holders, gate.split_dim, down.split_dim) == ((2, 3), 0, 1)
    assert split["model.layers.0.mlp.gate.weight"].holders == (0,)


def _simulated_export(plan: QuantizationPlan, layout: ParallelLayout, weights: dict[str, torch.Tensor]):
    """The distributed export's math with every rank simulated in one process (the exporter's
    steps: amax all-reduce, local quantization or BF16 gather, concatenation in holder order)."""
    for u in ShardMap.build(layout, SHAPES, plan).units:
        if not u.is_split:
            yield from quantize_stream(plan, [(p.name, weights[p.name]) for p in u.members])
            continue
        shards = {r: [p.shard_of(weights[p.name], r) for p in u.members] for r in u.holders}
        amax = max(local_amax(s) for s in shards.values())
        gs = global_scale_from_amax(amax, u.name) if u.has_global_scale else None
        for j, (p, d, mode) in enumerate(zip(u.members, u.decisions, u.modes, strict=True)):
            if mode == "local":
                pieces = [quantize_shard(plan, d, shards[r][j], gs) for r in u.holders]
                full = concat_shards(pieces, p.split_dim or 0, p.name, p.sections)
            else:
                whole = concat_shards([{"weight": shards[r][j]} for r in u.holders], p.split_dim or 0, p.name, p.sections)
                full = quantize_shard(plan, d, whole["weight"], gs)
            yield from checkpoint_items(plan, d, full)


LAYOUTS = [ParallelLayout(tp=2, pp=2), ParallelLayout(tp=2, ep=2), ParallelLayout(tp=2, ep=2, etp=2),
           ParallelLayout(tp=4, ep=4)]


@pytest.fixture(scope="module")
def references(weights: dict) -> dict:
    """The single-process export per preset pair, computed once."""
    cache: dict = {}

    def get(plan: QuantizationPlan, key: tuple) -> list:
        if key not in cache:
            cache[key] = list(quantize_stream(plan, weights.items()))
        return cache[key]

    return get  # type: ignore[return-value]


@pytest.mark.parametrize("presets", [("FP8_BLOCK", "NVFP4"), ("MXFP8", "MXFP4"), ("NVFP4", "NVFP4"), (None, None)])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.describe().replace(" ", "-"))
def test_hybrid_sharded_export_is_bit_identical(presets: tuple, layout: ParallelLayout, weights: dict, references) -> None:
    plan = QuantizationPlan.from_presets(linear=presets[0], moe=presets[1])
    reference = references(plan, presets)
    got = list(_simulated_export(plan, layout, weights))
    assert [n for n, _ in got] == [n for n, _ in reference]
    for (name, a), (_, b) in zip(got, reference, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), name


def test_gdn_sections_are_gathered_when_quantized_and_b_a_stay_bf16() -> None:
    plan = QuantizationPlan.from_presets(linear="FP8_BLOCK", moe="NVFP4")
    units = {u.name: u for u in ShardMap.build(ParallelLayout(tp=2), SHAPES, plan).units}
    assert units["model.layers.0.linear_attn.in_proj_qkv.weight"].modes == ("gather",)  # q/k/v shares are not contiguous
    assert units["model.layers.0.linear_attn.in_proj_z.weight"].modes == ("local",)  # 128-row shards
    b = units["model.layers.0.linear_attn.in_proj_b.weight"]
    assert not b.decisions[0].is_quantized and b.modes == ("local",)  # the seeds' rule: b/a in BF16


def test_concat_by_sections_restores_the_section_order() -> None:
    full = torch.arange(12).reshape(12, 1)
    from domain.refit.shard_map import Placement

    p = Placement("conv1d.weight", (12, 1), 0, (0, 1), (4, 4, 4))
    shards = [p.shard_of(full, r) for r in (0, 1)]
    assert shards[0].flatten().tolist() == [0, 1, 4, 5, 8, 9]
    assert torch.equal(concat_shards([{"weight": s} for s in shards], 0, p.name, p.sections)["weight"], full)
