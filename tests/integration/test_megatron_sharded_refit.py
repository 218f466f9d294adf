"""Refit from real sharded Megatron-Core trainers: tp, pp and ep in {1, 2} (at most 4 ranks),
dense, MoE and hybrid (GatedDeltaNet, gated attention, shared experts, MTP) models.

One world of 4 gloo processes builds every case's model with megatron-core and captures what the
sharded trainer adapter gives each rank (tests/distributed/megatron_support.py). The reference is
independent of the adapter: the global tensors are rebuilt from Megatron's own sharded_state_dict
(global keys, shapes and offsets), loaded into a tp = pp = ep = 1 model and exported by the
single-process path (`hf_named_weights`, `quantize_stream`; that export is checked against
compressed-tensors elsewhere). The refits run the production DistributedRefitService with the
in-memory collectives (every rank a thread) over the captured shards, for every plan: the engine
must receive tensors byte-identical to the unsharded export (elements, block scales, global
scales). A failure on any trainer rank must abort the refit everywhere with the engine kept.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (the `megatron` extra)")
pytest.importorskip("fla", reason="megatron-core's GatedDeltaNet needs flash-linear-attention")

from adapters.distributed.launch import launch_world
from adapters.memory.collectives import InMemoryWorld
from adapters.memory.faults import RankFault
from adapters.memory.faulty import RankPorts, wrap_rank
from adapters.memory.recording import RecordingEngine
from app.services.distributed_refit import DistributedRefitService
from domain.errors import DistributedRefitFailed
from domain.quant import naming
from domain.quant.plan import QuantizationPlan
from domain.quant.stream import quantize_stream
from domain.refit.shard_map import ShardMap, place_tensors
from domain.refit.topology import RefitWorld
from tests.distributed.megatron_support import (
    Case,
    RecordedShards,
    capture_rank,
    layout_of,
    reference_weights,
    unpack,
)
from tests.megatron_cpu import megatron_cpu

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

CASES = [
    Case("moe", tp=2), Case("moe", pp=2), Case("moe", ep=2), Case("moe", tp=2, pp=2), Case("moe", tp=2, ep=2),
    Case("moe", tp=2, ep=2, etp=2), Case("moe", pp=2, ep=2), Case("moe", tp=2, pp=2, ep=2),
    Case("dense-tied", tp=2, pp=2),
    Case("hybrid", tp=2), Case("hybrid", tp=2, pp=2), Case("hybrid", tp=2, ep=2),
]
PLANS = {"BF16": (None, None), "FP8_BLOCK": ("FP8_BLOCK", "FP8_BLOCK"), "MXFP8": ("MXFP8", "MXFP8"),
         "MXFP4": ("MXFP4", "MXFP4"), "NVFP4": ("NVFP4", "NVFP4")}


@pytest.fixture(scope="module")
def captured() -> dict[str, dict[str, Any]]:
    # forkserver: the processes start clean, whatever Megatron this test process ran before.
    results = launch_world(capture_rank, 4, (CASES,), timeout_s=240, start_method="forkserver")
    failed = [f"rank {r.rank}: {r.error}\n{r.traceback or ''}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    out = {}
    with megatron_cpu(), torch.compiler.set_stance("force_eager"):
        for i, case in enumerate(CASES):
            records = [r.value[i] for r in results][: case.ranks]
            out[case.id] = {"case": case, "records": records, "reference": reference_weights(case, records)}
    return out


def _plan(name: str) -> QuantizationPlan:
    linear, moe = PLANS[name]
    return QuantizationPlan.from_presets(linear=linear, moe=moe)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_rank_lists_the_unsharded_models_tensors_and_holds_their_slices(case: Case, captured) -> None:
    data = captured[case.id]
    reference, records = data["reference"], data["records"]
    shapes = records[0]["shapes"]
    assert all(r["shapes"] == shapes for r in records), "ranks disagree on the model's tensor list"
    assert [(n, tuple(s)) for n, s in shapes] == [(n, tuple(t.shape)) for n, t in reference.items()]
    placements = place_tensors(layout_of(records[0]), shapes)
    held = 0
    for rank, record in enumerate(records):
        declared = {d["name"]: d for d in record["declared"]}  # what the adapter says of each shard
        for name, data_ in record["shards"].items():
            p, d = placements[name], declared[name]
            assert d["group"] == naming.classify(name, p.shape).group and tuple(d["shape"]) == p.shape, name
            if rank in p.holders:
                assert (d["split_dim"], d["index"], d["group_size"]) == (p.split_dim, p.holders.index(rank), len(p.holders))
                assert torch.equal(unpack(data_), p.shard_of(reference[name], rank)), (rank, name)
                held += 1
    assert held >= len(shapes)  # every tensor is held by its placement's holders


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_the_adapter_reads_the_parameters_as_they_are_after_an_update(case: Case, captured) -> None:
    """Every tensor, views of a parameter and derived ones alike (q/k/v of several query groups,
    gated q_proj, GDN's joined q/k/v), follows an in-place update of the parameters: a refit after
    a training step sends the trained weights, not those of the adapter's build."""
    for rank, record in enumerate(captured[case.id]["records"]):
        assert record["after_update"]["stale"] == [], rank
        assert record["after_update"]["unchanged"] == [], rank


def test_the_adapter_names_what_differs_from_megatrons_layout(captured) -> None:
    records = captured[Case("moe", tp=2, pp=2).id]["records"]
    for rank, record in enumerate(records):
        refused = record["refused"]
        assert refused["layout"].startswith("ShardingError: actor.megatron: the refit's trainer layout is tp=2 pp=4")
        assert "layers must be split evenly over the pipeline stages" in refused["stage"], rank
        assert "the refit expects" in refused["position"] and f"rank {rank} holds" in refused["position"]


def _run(case_data: dict[str, Any], plan: QuantizationPlan, weights: list[dict[str, torch.Tensor]],
         fault: RankFault | None = None, steps: int = 1, engines: Any = None) -> list[dict[str, Any]]:
    """`steps` refits in a world of threads: the trainer ranks replay the captured shards (scaled by
    2 ** step, an exact change), one RecordingEngine receives (or the engines `engines(n)` makes
    for the n-th engine rank, as many as it has). Returns per rank its outcomes and, on engines,
    the engine and its live tensors after each refit."""
    records = case_data["records"]
    layout = layout_of(records[0])
    count = getattr(engines, "count", 1)
    world = RefitWorld(layout, count)
    shared = InMemoryWorld(world, step_timeout_s=60, phase_timeout_s=60)
    shapes = [(n, tuple(s)) for n, s in records[0]["shapes"]]
    engine_layout = {n: (tuple(t.shape), t.dtype) for n, t in quantize_stream(plan, weights[0].items())}
    results: dict[int, Any] = {}

    def rank_main(rank: int) -> None:
        try:
            shards = None
            engine = None
            if rank < layout.size:
                shards = {n: unpack(b) for n, b in records[rank]["shards"].items()}
                trainer: Any = RecordedShards(shapes, shards)
            else:
                n = rank - layout.size
                trainer, engine = None, engines(n) if engines is not None else RecordingEngine(engine_layout)
            ports = wrap_rank(fault, RankPorts(shared.collectives(rank), trainer, engine), world.role(rank),
                              ShardMap.build(layout, shapes, plan), hang_s=0.1)
            svc = DistributedRefitService(world, ports.comm, plan, shapes, trainer=ports.trainer, engine=ports.engine,
                                          bucket_bytes=64 << 10)
            out: dict[str, Any] = {"outcomes": [], "errors": [], "live": [], "engine": engine}
            for step in range(steps):
                if step and shards is not None:
                    for t in shards.values():
                        t.mul_(2)
                try:
                    out["outcomes"].append(svc.refit().outcome.value)
                    out["errors"].append(None)
                except DistributedRefitFailed as err:
                    out["outcomes"].append(err.report.outcome.value)
                    out["errors"].append(str(err))
                if engine is not None:
                    out["live"].append({n: t.clone() for n, t in engine.live_weights().items()})
            results[rank] = out
        except BaseException as err:  # reported below
            results[rank] = err

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    errors = {r: v for r, v in results.items() if isinstance(v, BaseException)}
    assert not errors and len(results) == world.size, errors
    return [results[r] for r in range(world.size)]


def _assert_receives(live: dict[str, torch.Tensor], plan: QuantizationPlan, weights: dict[str, torch.Tensor]) -> None:
    want = dict(quantize_stream(plan, weights.items()))
    assert live.keys() == want.keys()
    differ = [n for n, t in want.items() if live[n].dtype != t.dtype or not torch.equal(_bytes(live[n]), _bytes(t))]
    assert not differ, f"{len(differ)} tensors differ from the unsharded export, e.g. {differ[:4]}"


# Every plan on every layout of the MoE and tied models; the hybrid (slow to quantize: 4 layers of
# experts and an MTP layer) with the three plans that cover its every code path.
REFITS = [(c, p) for c in CASES for p in PLANS if c.model != "hybrid" or p in ("BF16", "FP8_BLOCK", "NVFP4")]


@pytest.mark.parametrize(("case", "plan_name"), REFITS, ids=[f"{c.id}-{p}" for c, p in REFITS])
def test_sharded_refit_is_byte_identical_to_the_unsharded_export(case: Case, plan_name: str, captured) -> None:
    plan, data = _plan(plan_name), captured[case.id]
    results = _run(data, plan, [data["reference"]])
    assert all(r["outcomes"] == ["live"] for r in results), [r["errors"] for r in results]
    live = results[-1]["live"][0]
    _assert_receives(live, plan, data["reference"])
    if plan_name == "NVFP4":  # the global scales of fused groups split across TP ranks, named
        group = [n for n in live if n.endswith("self_attn.q_proj.weight_global_scale")]
        assert group and all(torch.equal(live[n], live[n.replace("q_proj", "k_proj")]) for n in group)


FAULTS = [
    ("export:0 on a TP peer that is an expert source", Case("moe", tp=2, pp=2, ep=2), RankFault(1, "export", 0, refit=1)),
    # Buckets are numbered across the refit: rank 0 sends 0-2 (64 KiB buckets, NVFP4), rank 2 then 3-5.
    ("bucket:4 on the last stage's source", Case("moe", tp=2, pp=2, ep=2), RankFault(2, "bucket", 4, refit=1)),
    ("begin on a data-parallel replica", Case("moe", ep=2), RankFault(1, "begin", refit=1)),
    ("export:3 on a GDN TP peer", Case("hybrid", tp=2), RankFault(1, "export", 3, refit=1)),
]


@pytest.mark.parametrize(("what", "case", "fault"), FAULTS, ids=[f[0] for f in FAULTS])
def test_a_trainer_rank_failure_aborts_the_refit_everywhere_and_keeps_the_engine(what, case: Case, fault, captured) -> None:
    """Refit 0 succeeds; refit 1 (weights doubled) fails on one trainer rank; refit 2 succeeds."""
    plan, data = _plan("NVFP4"), captured[case.id]
    doubled = {n: t * 2 for n, t in data["reference"].items()}
    results = _run(data, plan, [data["reference"]], fault=fault, steps=3)
    assert all(r["outcomes"][0] == "live" and r["outcomes"][2] == "live" for r in results)
    assert {r["outcomes"][1] for r in results} == {"rolled-back"}
    assert len({r["errors"][1] for r in results}) == 1 and f"rank {fault.rank} (trainer)" in results[0]["errors"][1]
    live = results[-1]["live"]
    _assert_receives(live[1], plan, data["reference"])  # kept: bit for bit the refit-0 weights
    _assert_receives(live[2], plan, {n: t * 2 for n, t in doubled.items()})


class _EngineGroup:
    """Two TensorParallelEngine ranks (threads) and the collective they serve with."""

    count = 2

    def __init__(self, plan: QuantizationPlan) -> None:
        from adapters.reference.config import MICRO_MOE

        self.plan, self.config = plan, MICRO_MOE
        self._barrier = threading.Barrier(2)
        self._box: dict[int, Any] = {}

    def gather(self, rank: int) -> Any:
        def everyone(mine: Any) -> list[Any]:
            self._box[rank] = dict(mine)
            self._barrier.wait(30)
            out = [self._box[r] for r in range(2)]
            self._barrier.wait(30)
            return out

        return everyone

    def __call__(self, n: int) -> Any:
        from adapters.reference.tp_engine import TensorParallelEngine

        return TensorParallelEngine(self.config, self.plan, 2, n, gather=self.gather(n))


@pytest.mark.parametrize("plan_name", ["BF16", "NVFP4", "MXFP8"])
@pytest.mark.parametrize("case", [Case("moe", tp=2, pp=2, ep=2), Case("moe", tp=2)], ids=lambda c: c.id)
def test_an_engine_with_its_own_tensor_parallelism_takes_its_shares_of_the_same_stream(case: Case, plan_name: str,
                                                                                      captured) -> None:
    """Two engine ranks (the reference engine's tensor-parallel mode, tp=2) receive the same
    stream from a sharded Megatron trainer: each keeps its shares, which put together are the
    tp=1 engine's weights bit for bit, and the two ranks serve the tp=1 engine's log-probs."""
    from adapters.reference.config import MICRO_MOE
    from adapters.reference.engine import ReferenceEngine
    from adapters.reference.tp_engine import unshard
    from domain.refit.buckets import pack_buckets

    plan, data = _plan(plan_name), captured[case.id]
    group = _EngineGroup(plan)
    results = _run(data, plan, [data["reference"]], engines=group)
    assert all(r["outcomes"] == ["live"] for r in results), [r["errors"] for r in results]
    single = ReferenceEngine(MICRO_MOE, plan)  # the tp=1 engine, refit in one process from the unsharded export
    single.begin_refit(1)
    for bucket in pack_buckets(quantize_stream(plan, data["reference"].items()), 1 << 20):
        single.load_bucket(bucket)
    single.finalize_refit()
    engines = [r["engine"] for r in results[-2:]]
    shares = [e.shares() for e in engines]
    rebuilt = unshard(MICRO_MOE, plan, shares).live_weights()
    for name, t in single.live_weights().items():
        assert torch.equal(_bytes(rebuilt[name]), _bytes(t)), name
    q = next(n for n in single.layout.targets if ".layers.0.self_attn.q_proj." in n and "global" not in n)
    assert all(2 * s[q].shape[0] == single.layout.targets[q].shape[0] for s in shares)  # each rank: half the rows
    ids = torch.randint(0, MICRO_MOE.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    served: dict[int, torch.Tensor] = {}
    threads = [threading.Thread(target=lambda i=i: served.__setitem__(i, engines[i].log_probs(ids)[0])) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    want = single.log_probs(ids)[0]
    assert torch.equal(served[0], want) and torch.equal(served[1], want)
