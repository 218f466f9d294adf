"""domain.refit.topology, split_rules and shard_map: layouts, placements, export units, and the
shard math against the single-process export (quantize_stream) as the independent reference, bit
for bit."""

from __future__ import annotations

import pytest
import torch

from adapters.reference.config import MICRO_MOE, TINY_DENSE, hf_weight_shapes
from adapters.reference.trainer import ReferenceTrainer
from domain.errors import NonFiniteTensor, ShardingError
from domain.quant import naming
from domain.quant.codecs import nvfp4_global_scale
from domain.quant.plan import QuantizationPlan
from domain.quant.stream import checkpoint_names, quantize_stream
from domain.refit.shard_map import ShardMap, place_tensors
from domain.refit.shard_quant import (
    checkpoint_items,
    concat_shards,
    flatten_piece,
    global_scale_from_amax,
    local_amax,
    quantize_shard,
    unflatten_piece,
)
from domain.refit.topology import ParallelLayout, RefitWorld

SHAPES = hf_weight_shapes(MICRO_MOE)


def _plan(linear: str | None, moe: str | None) -> QuantizationPlan:
    return QuantizationPlan.from_presets(linear=linear, moe=moe)


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return dict(ReferenceTrainer.from_seed(MICRO_MOE, 3).named_weights())


def test_layout_follows_megatron_rank_order() -> None:
    # etp = tp: expert groups are the dense TP groups of each data-parallel replica (8 ranks).
    layout = ParallelLayout(tp=2, pp=2, ep=2, etp=2)
    assert layout.size == 8 and layout.per_stage == 4
    for rank in range(8):
        c = layout.coords(rank)
        assert (c.stage, c.ep_rank, c.tp_rank, c.etp_rank) == (rank // 4, (rank // 2) % 2, rank % 2, rank % 2)
        assert layout.rank_of(c.stage, c.ep_rank, c.tp_rank) == rank
    assert layout.tp_ranks(1, 1) == (6, 7) and layout.dense_ranks(1) == (4, 5)
    # etp = 1: expert parallelism is carved out of the TP ranks (4 ranks hold tp=2 pp=2 ep=2).
    carved = ParallelLayout(tp=2, pp=2, ep=2)
    assert carved.size == 4 and carved.describe() == "tp=2 pp=2 ep=2"
    assert [(c.stage, c.tp_rank, c.ep_rank) for c in map(carved.coords, range(4))] == [
        (0, 0, 0), (0, 1, 1), (1, 0, 0), (1, 1, 1)]
    assert carved.tp_ranks(0, 0) == (0, 1) and carved.tp_ranks(0, 1) == (1,) and carved.expert_ranks(1, 1) == (3,)
    # ep = 2 alone: the second rank is a data-parallel replica of the dense layers that owns half the experts.
    assert ParallelLayout(ep=2).coords(1) == ParallelLayout(ep=2).coords(1).__class__(0, 1, 0, 0, 1)
    # More data-parallel replicas than the experts need: their ranks hold copies and export nothing.
    wide = ParallelLayout(tp=2, ep=2, dp=4)
    assert wide.size == 8 and wide.describe() == "tp=2 pp=1 ep=2 dp=4" and wide.coords(6).dp_rank == 3
    assert wide.dense_ranks(0) == (0, 1) and wide.expert_ranks(0, 1) == (1,)
    with pytest.raises(ShardingError, match="must be a multiple of ep"):
        ParallelLayout(tp=1, ep=2, dp=3)
    with pytest.raises(ShardingError, match="outside"):
        layout.coords(8)
    with pytest.raises(ShardingError, match="tp: must be >= 1"):
        ParallelLayout(tp=0)
    with pytest.raises(ShardingError, match=r"expert_tensor_parallel_size.*etp=2 with tp=4"):
        ParallelLayout(tp=4, ep=2, etp=2)


def test_world_roles_and_default_shapes() -> None:
    world = RefitWorld(ParallelLayout(tp=2), engines=2)
    assert world.trainer_ranks == (0, 1) and world.engine_ranks == (2, 3)
    assert [world.role(r) for r in range(4)] == ["trainer", "trainer", "engine", "engine"]
    with pytest.raises(ShardingError, match="outside the refit world"):
        world.role(4)
    assert RefitWorld.for_procs(2) == RefitWorld(ParallelLayout(), 1)
    assert RefitWorld.for_procs(3) == RefitWorld(ParallelLayout(ep=2), 1)
    assert RefitWorld.for_procs(4, moe=False) == RefitWorld(ParallelLayout(tp=2), 2)
    with pytest.raises(ShardingError, match="--procs"):
        RefitWorld.for_procs(5)


def test_tensor_parallel_placement() -> None:
    p = place_tensors(ParallelLayout(tp=2), SHAPES)
    assert p["model.layers.0.self_attn.q_proj.weight"].split_dim == 0
    assert p["model.layers.0.self_attn.o_proj.weight"].split_dim == 1
    assert p["model.layers.0.mlp.down_proj.weight"].split_dim == 1
    assert p["model.embed_tokens.weight"].split_dim == 0 and p["lm_head.weight"].split_dim == 0
    for name in ("model.layers.0.input_layernorm.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.1.mlp.experts.2.up_proj.weight"):
        assert p[name].split_dim is None and p[name].holders == (0,)
    assert p["model.layers.0.self_attn.q_proj.weight"].holders == (0, 1)


def test_pipeline_and_expert_placement() -> None:
    pp = place_tensors(ParallelLayout(pp=2), SHAPES)
    assert pp["model.embed_tokens.weight"].holders == (0,)
    assert pp["model.layers.0.self_attn.q_proj.weight"].holders == (0,)
    assert pp["model.layers.1.self_attn.q_proj.weight"].holders == (1,)
    assert pp["lm_head.weight"].holders == (1,) and pp["model.norm.weight"].holders == (1,)
    ep = place_tensors(ParallelLayout(ep=2), SHAPES)
    assert ep["model.layers.1.mlp.experts.1.gate_proj.weight"].holders == (0,)
    assert ep["model.layers.1.mlp.experts.2.gate_proj.weight"].holders == (1,)
    assert ep["model.layers.1.mlp.gate.weight"].holders == (0,)


@pytest.mark.parametrize(
    ("layout", "key"),
    [
        (ParallelLayout(tp=3), "actor.megatron.tensor_model_parallel_size"),
        (ParallelLayout(pp=3), "actor.megatron.pipeline_model_parallel_size"),
        (ParallelLayout(ep=3), "actor.megatron.expert_model_parallel_size"),
    ],
)
def test_layouts_that_do_not_divide_the_model_name_the_key(layout: ParallelLayout, key: str) -> None:
    with pytest.raises(ShardingError, match=key):
        place_tensors(layout, SHAPES)


def test_expert_parallelism_needs_experts() -> None:
    with pytest.raises(ShardingError, match="no routed"):
        place_tensors(ParallelLayout(ep=2), hf_weight_shapes(TINY_DENSE))


def test_shards_tile_the_full_tensor(weights: dict[str, torch.Tensor]) -> None:
    for p in place_tensors(ParallelLayout(tp=4), SHAPES).values():
        shards = [weights[p.name][p.shard_slices(r)] for r in p.holders]
        whole = torch.cat(shards, dim=p.split_dim) if p.split_dim is not None else shards[0]
        assert torch.equal(whole, weights[p.name]), p.name


@pytest.mark.parametrize("presets", [("FP8_BLOCK", "NVFP4"), ("NVFP4", "MXFP4"), (None, None)])
def test_units_follow_the_single_process_emission_order(presets: tuple, weights: dict[str, torch.Tensor]) -> None:
    plan = _plan(*presets)
    shard_map = ShardMap.build(ParallelLayout(tp=2, pp=2, ep=2), SHAPES, plan)
    names = [n for u in shard_map.units for p, d in zip(u.members, u.decisions, strict=True)
             for n in checkpoint_names(plan, d, p.shape)]
    assert names == [n for n, _ in quantize_stream(plan, weights.items())]
    sources = [s for s, _ in shard_map.segments()]
    layout = shard_map.layout
    # Each stage's dense source (its first rank) and each expert-parallel rank's first rank send;
    # stage 0 holds the dense layer 0 only, so rank 1 (ep_rank 1 of stage 0) has nothing to send.
    assert sources == [0, 2, 3] and [layout.coords(s).ep_rank for s in sources] == [0, 0, 1]


def test_modes_gather_when_shards_straddle_blocks() -> None:
    units = {u.name: u for u in ShardMap.build(ParallelLayout(tp=2), SHAPES, _plan("FP8_BLOCK", None)).units}
    assert units["model.layers.0.mlp.gate_proj.weight"].modes == ("local",)  # 256 rows: 128 per rank
    assert units["model.layers.0.self_attn.k_proj.weight"].modes == ("gather",)  # 64-row shards, 128-row blocks
    mx = {u.name: u for u in ShardMap.build(ParallelLayout(tp=8), SHAPES, _plan("MXFP8", None)).units}
    assert mx["model.layers.0.self_attn.o_proj.weight"].modes == ("gather",)  # K shard 16 < 32
    nv = ShardMap.build(ParallelLayout(tp=2), SHAPES, _plan("NVFP4", "NVFP4"))
    assert all(m == "local" for u in nv.units for m in u.modes)


def _simulated_tp_export(plan: QuantizationPlan, layout: ParallelLayout, weights: dict[str, torch.Tensor]):
    """The distributed export's math with every TP rank simulated in one process."""
    shard_map = ShardMap.build(layout, SHAPES, plan)
    for u in shard_map.units:
        if not u.is_split:
            yield from quantize_stream(plan, [(p.name, weights[p.name]) for p in u.members])
            continue
        shards = {r: [weights[p.name][p.shard_slices(r)] for p in u.members] for r in u.holders}
        amax = max(local_amax(s) for s in shards.values())  # the all-reduce MAX
        gs = global_scale_from_amax(amax, u.name) if u.has_global_scale else None
        for j, (p, d, mode) in enumerate(zip(u.members, u.decisions, u.modes, strict=True)):
            if mode == "local":
                full = concat_shards([quantize_shard(plan, d, shards[r][j], gs) for r in u.holders], p.split_dim, p.name)
            else:
                whole = torch.cat([shards[r][j] for r in u.holders], dim=p.split_dim)
                full = quantize_shard(plan, d, whole, gs)
            yield from checkpoint_items(plan, d, full)


@pytest.mark.parametrize("presets", [("NVFP4", "NVFP4"), ("FP8_BLOCK", "MXFP4"), ("MXFP8", "NVFP4"), (None, None)])
@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_export_is_bit_identical_to_single_process(presets: tuple, tp: int, weights: dict[str, torch.Tensor]) -> None:
    plan = _plan(*presets)
    reference = list(quantize_stream(plan, weights.items()))
    got = list(_simulated_tp_export(plan, ParallelLayout(tp=tp), weights))
    assert [n for n, _ in got] == [n for n, _ in reference]
    for (name, a), (_, b) in zip(got, reference, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b), name


def test_global_scale_from_shard_amax_equals_the_groups(weights: dict[str, torch.Tensor]) -> None:
    group = "model.layers.0.self_attn.qkv"
    members = [weights[f"{m}.weight"] for m in naming.group_members(group)]
    shards = [[t[r * t.shape[0] // 2 : (r + 1) * t.shape[0] // 2] for t in members] for r in range(2)]
    amax = torch.maximum(local_amax(shards[0]), local_amax(shards[1]))
    assert torch.equal(global_scale_from_amax(amax, group), nvfp4_global_scale(*members, name=group))
    zero = torch.zeros(4, 16, dtype=torch.bfloat16)
    assert torch.equal(global_scale_from_amax(local_amax([zero]), "z"), nvfp4_global_scale(zero, name="z"))
    assert float(local_amax([])) == 0.0
    bad = torch.full((2, 16), float("nan"))
    with pytest.raises(NonFiniteTensor, match="'g'"):
        global_scale_from_amax(local_amax([bad]), "g")


def test_concat_rejects_pieces_with_different_global_scales() -> None:
    a = {"weight_packed": torch.zeros(2, 8, dtype=torch.uint8), "weight_global_scale": torch.tensor([1.0])}
    b = {"weight_packed": torch.zeros(2, 8, dtype=torch.uint8), "weight_global_scale": torch.tensor([2.0])}
    with pytest.raises(ShardingError, match="different global scales"):
        concat_shards([a, b], 0, "w")
    joined = concat_shards([a, a], 1, "w")
    assert joined["weight_packed"].shape == (2, 16) and torch.equal(joined["weight_global_scale"], a["weight_global_scale"])


def test_flattened_pieces_round_trip_every_dtype() -> None:
    piece = {
        "weight_packed": torch.randint(0, 255, (3, 5), dtype=torch.uint8),  # odd size before a float32
        "weight_scale": torch.randn(3, 2),
        "e4m3": torch.randn(7).to(torch.float8_e4m3fn),
        "bf16": torch.randn(5, 3).to(torch.bfloat16),
    }
    back = unflatten_piece(flatten_piece(piece), piece)
    assert list(back) == list(piece)
    for k, t in piece.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k].view(torch.uint8), t.view(torch.uint8)), k
