"""The reference engine's tensor-parallel mode: every rank keeps its share of the same full stream.

The reference is the tp=1 ReferenceEngine refit from the same stream: the ranks' shares put
together must be its live tensors bit for bit, and the ranks must serve its log-probs exactly.
"""

from __future__ import annotations

import pytest
import torch

from adapters.reference.config import MICRO_MOE, TINY_MOE
from adapters.reference.engine import ReferenceEngine
from adapters.reference.tp_engine import TensorParallelEngine, shard_config, unshard
from adapters.reference.trainer import ReferenceTrainer
from domain.errors import EngineStale, EngineTensorMismatch, ShardingError
from domain.quant.plan import QuantizationPlan
from domain.quant.stream import quantize_stream
from domain.refit.buckets import pack_buckets
from domain.refit.engine_shard import engine_shard


def _refit(engines, stream) -> None:
    for e in engines:
        e.begin_refit(1)
        for b in pack_buckets(stream, 1 << 18):
            e.load_bucket(b)
        e.finalize_refit()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("presets", [(None, None), ("NVFP4", "NVFP4"), ("MXFP8", "MXFP4")])
def test_shares_make_up_the_tp1_engine_and_serve_its_log_probs(presets) -> None:
    tp, cfg = 2, MICRO_MOE
    plan = QuantizationPlan.from_presets(linear=presets[0], moe=presets[1])
    stream = list(quantize_stream(plan, ReferenceTrainer.from_seed(cfg, 1).named_weights()))
    ranks = [TensorParallelEngine(cfg, plan, tp, r) for r in range(tp)]
    single = ReferenceEngine(cfg, plan)
    _refit([*ranks, single], stream)
    full = dict(stream)
    for r, e in enumerate(ranks):  # each rank keeps exactly its share of every checkpoint tensor
        for name, share in e.shares().items():
            local, hf, shape = e._sources[name]
            assert torch.equal(_bytes(share), _bytes(engine_shard(local, full[name], hf, shape, tp, r))), name
    rebuilt = unshard(cfg, plan, [e.shares() for e in ranks])
    for name, t in single.live_weights().items():
        assert torch.equal(_bytes(rebuilt.live_weights()[name]), _bytes(t)), name
    w13 = "layers.1.w13.weight_packed" if presets[1] else "layers.1.w13.weight"
    assert ranks[0].live_weights()[w13].shape[1] * tp == single.live_weights()[w13].shape[1]  # 1/tp of each expert
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    everyone = [e.shares() for e in ranks]
    served = TensorParallelEngine(cfg, plan, tp, 0, gather=lambda mine: everyone)
    _refit([served], stream)
    assert torch.equal(served.log_probs(ids)[0], single.log_probs(ids)[0])


def test_shares_that_split_a_block_are_refused_naming_the_module() -> None:
    plan = QuantizationPlan.from_presets(linear="FP8_BLOCK", moe=None)
    with pytest.raises(EngineTensorMismatch, match=r"v_proj.*not a multiple of the FP8_BLOCK block"):
        TensorParallelEngine(TINY_MOE, plan, 2, 0)  # 64-row v shares start inside a 128-row block
    with pytest.raises(ShardingError, match="tp=3 does not divide vocab_size=512"):
        shard_config(MICRO_MOE, 3)
    with pytest.raises(ShardingError, match=r"o_proj.weight \(weight_scale\).*does not split its 1 blocks"):
        engine_shard("weight_scale", torch.empty(128, 1), "model.layers.0.self_attn.o_proj.weight", (128, 128), 2, 0)


def test_a_rank_serves_only_with_its_peers_and_never_stale() -> None:
    plan = QuantizationPlan.bf16()
    stream = list(quantize_stream(plan, ReferenceTrainer.from_seed(MICRO_MOE, 0).named_weights()))
    alone = TensorParallelEngine(MICRO_MOE, plan, 2, 0)
    _refit([alone], stream)
    with pytest.raises(ShardingError, match="serves with its peers"):
        alone.log_probs(torch.zeros(1, 4, dtype=torch.int64))
    peers = TensorParallelEngine(MICRO_MOE, plan, 2, 0, gather=lambda mine: [mine, mine])
    _refit([peers], stream)
    peers.mark_stale("a peer failed")
    with pytest.raises(EngineStale):
        peers.log_probs(torch.zeros(1, 4, dtype=torch.int64))
