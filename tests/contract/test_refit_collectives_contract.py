"""Contract of the RefitCollectives port, run against the in-memory collectives (ranks as threads)
and the torch.distributed ones (ranks as processes over gloo on 127.0.0.1).

World: a tp=2 trainer (ranks 0, 1) and one engine (rank 2). Every rank runs the same scenario:
an agreement returns every rank's status by rank; a turn of source 0 tells its TP group and the
engines whether anyone failed and the largest next index; a TP exchange returns the exact
maximum amax; a TP gather hands the source every holder's piece in TP order; the source's bucket
stream reaches the engine in order, bit for bit, with the room the transport asks for in front of
each packed bucket. A rank that never arrives makes the others time out naming rank and step.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from adapters.memory.collectives import InMemoryWorld
from domain.errors import CollectiveTimeout
from domain.refit.buckets import BucketPlanner
from domain.refit.status import RankStatus
from domain.refit.topology import ParallelLayout, RefitWorld

WORLD = RefitWorld(ParallelLayout(tp=2), engines=1)
TENSORS = [(f"t{i}", torch.arange(64 * (i + 1), dtype=torch.float32).reshape(-1, 8) * (i + 1)) for i in range(5)]


def scenario(rank: int, comm: Any) -> dict[str, Any]:
    """What one rank sees; plain data (it crosses process boundaries)."""
    out: dict[str, Any] = {}
    role = WORLD.role(rank).value
    mine = RankStatus(rank, role).failed("step", "boom") if rank == 1 else RankStatus(rank, role)
    out["agree"] = [(s.rank, s.ok) for s in comm.agree("contract", mine)]
    out["turn"] = comm.turn(0, "turn of rank 0", rank == 2, rank * 10)
    if rank in (0, 1):
        failed, amax = comm.tp_exchange((0, 1), "exchange", False, torch.tensor(rank + 0.5))
        out["exchange"] = (failed, float(amax))
        piece = torch.full((16,), rank + 1, dtype=torch.uint8)
        failed, pieces = comm.tp_gather((0, 1), "gather", piece, rank == 1)
        out["gather"] = (failed, [p.tolist() for p in pieces])
    if rank == 0:
        planner = BucketPlanner(1024, lead_bytes=comm.lead_bytes)
        stats = comm.transport(0, refit_id=1).send(planner.pack(iter(TENSORS)))
        out["sent"] = stats.buckets
    elif rank == 2:
        got: list[tuple[int, str, list[float]]] = []

        def consume(bucket: Any) -> None:
            from domain.refit.buckets import unpack_bucket

            got.extend((bucket.index, n, t.reshape(-1).tolist()) for n, t in unpack_bucket(bucket))

        stats = comm.transport(0, refit_id=1).receive(consume)
        out["received"] = (stats.buckets, got)
    return out


def _in_memory() -> list[dict[str, Any]]:
    shared = InMemoryWorld(WORLD, step_timeout_s=60, phase_timeout_s=60)
    results: dict[int, Any] = {}

    def run(rank: int) -> None:
        try:
            results[rank] = scenario(rank, shared.collectives(rank))
        except BaseException as err:  # reported below
            results[rank] = err

    threads = [threading.Thread(target=run, args=(r,)) for r in range(WORLD.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    errors = {r: v for r, v in results.items() if isinstance(v, BaseException)}
    assert not errors, errors
    return [results[r] for r in range(WORLD.size)]


def _torch_dist_rank(rank: int) -> dict[str, Any]:
    from adapters.distributed.collectives import TorchDistCollectives

    return scenario(rank, TorchDistCollectives(WORLD, rank, step_timeout_s=60, phase_timeout_s=60, bucket_bytes=1024))


def _torch_dist() -> list[dict[str, Any]]:
    from adapters.distributed.launch import launch_world

    results = launch_world(_torch_dist_rank, WORLD.size, timeout_s=90)
    failed = [f"rank {r.rank}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    return [r.value for r in results]


@pytest.fixture(scope="module", params=["in-memory", pytest.param("torch-dist", marks=pytest.mark.distributed)])
def seen(request) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    return _in_memory() if request.param == "in-memory" else _torch_dist()


def test_agreement_returns_every_status_by_rank(seen) -> None:
    for rank in range(WORLD.size):
        assert seen[rank]["agree"] == [(0, True), (1, False), (2, True)]


def test_turn_carries_any_failure_and_the_largest_next_index(seen) -> None:
    assert all(tuple(seen[r]["turn"]) == (True, 20) for r in range(WORLD.size))


def test_tp_exchange_is_the_exact_maximum(seen) -> None:
    assert seen[0]["exchange"] == seen[1]["exchange"] == (False, 1.5)


def test_tp_gather_hands_the_source_every_piece_in_tp_order(seen) -> None:
    failed, pieces = seen[0]["gather"]
    assert failed and pieces == [[1] * 16, [2] * 16]
    assert seen[1]["gather"] == (True, [])


def test_the_bucket_stream_reaches_the_engine_in_order_bit_for_bit(seen) -> None:
    buckets, got = seen[2]["received"]
    assert buckets == seen[0]["sent"] > 1
    assert [i for i, _, _ in got] == sorted(i for i, _, _ in got)
    assert [(n, v) for _, n, v in got] == [(n, t.reshape(-1).tolist()) for n, t in TENSORS]


def test_a_missing_rank_times_out_naming_rank_and_step() -> None:
    shared = InMemoryWorld(WORLD, step_timeout_s=0.3, phase_timeout_s=0.3)
    comm = shared.collectives(0)
    with pytest.raises(CollectiveTimeout, match=r"rank 0: timed out after 0.3 s at step 'agreement: lonely'") as err:
        comm.agree("lonely", RankStatus(0, "trainer"))
    assert err.value.peers == (1, 2)
    with pytest.raises(CollectiveTimeout, match="bucket 0"):
        shared.collectives(2).transport(0, refit_id=3).receive(lambda b: None)
