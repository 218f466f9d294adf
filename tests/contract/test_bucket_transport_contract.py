"""The BucketTransport contract, run against every adapter: in-process (two threads) and
torch.distributed (two processes over gloo on 127.0.0.1, marked distributed).

Scenarios: an ordered, intact stream with a tensor larger than a bucket; a source that fails
mid-stream (the receiver gets TransportAborted with the source's error); a receiver whose consumer
fails (it drains the stream, then raises; the source finishes); a receiver that keeps every bucket
in buffers of its own (`allocate`), intact after the stream.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import pytest
import torch

from domain.buckets import Bucket, BucketPlanner, unpack_bucket

SCENARIOS = ("order", "source_fails", "consumer_fails", "keep")
BUCKET = 8192


def _stream() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = [(f"t{i}", torch.randn(200 + 31 * i, generator=g).to(torch.bfloat16)) for i in range(30)]
    out.insert(10, ("big", torch.randn(3000, generator=g)))
    return out


def _hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def sender(scenario: str, transport: Any) -> dict[str, Any]:
    planner = BucketPlanner(BUCKET, reuse_buffer=True, buffers=transport.window)

    def items():
        for i, item in enumerate(_stream()):
            if scenario == "source_fails" and i == 12:
                raise ValueError("quantizing t11 failed")
            yield item

    try:
        stats = transport.send(planner.pack(items()))
        return {"buckets": stats.buckets, "payload": stats.payload_bytes}
    except Exception as err:
        return {"error": type(err).__name__, "text": str(err)}


def receiver(scenario: str, transport: Any) -> dict[str, Any]:
    seen: list[tuple[int, bool]] = []
    hashes: dict[str, str] = {}

    def consume(b: Bucket) -> None:
        seen.append((b.index, b.is_last))
        if scenario == "consumer_fails" and b.index == 1:
            raise RuntimeError("engine load failed")
        for name, view in unpack_bucket(b):
            hashes[name] = _hash(view)

    kept: list[Bucket] = []

    def keep(b: Bucket) -> None:
        seen.append((b.index, b.is_last))
        kept.append(b)

    try:
        if scenario == "keep":
            stats = transport.receive(keep, lambda n: torch.empty(n, dtype=torch.uint8))
            hashes.update({name: _hash(view) for b in kept for name, view in unpack_bucket(b)})
        else:
            stats = transport.receive(consume)
        out: dict[str, Any] = {"buckets": stats.buckets, "payload": stats.payload_bytes}
    except Exception as err:
        out = {"error": type(err).__name__, "text": str(err)}
    return {**out, "seen": seen, "hashes": hashes}


def _inprocess(scenario: str, window: int) -> tuple[dict, dict]:
    from adapters.transport.inprocess import InProcessTransport

    t = InProcessTransport(window=window, timeout_s=10)
    box: dict[str, dict] = {}
    th = threading.Thread(target=lambda: box.setdefault("recv", receiver(scenario, t)))
    th.start()
    sent = sender(scenario, t)
    th.join(timeout=30)
    return sent, box["recv"]


def world_rank(rank: int, window: int) -> list[dict[str, Any]]:
    """Rank 0 sends, rank 1 receives, every scenario in turn (one refit id each)."""
    from adapters.transport.torch_dist import TorchDistCollectives
    from domain.sharding import RefitWorld

    comm = TorchDistCollectives(RefitWorld(), rank, step_timeout_s=20, phase_timeout_s=20, bucket_bytes=BUCKET,
                                window=window)
    out = []
    for i, scenario in enumerate(SCENARIOS):
        t = comm.transport(0, refit_id=i + 1)
        out.append(sender(scenario, t) if rank == 0 else receiver(scenario, t))
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["window1", "window2"])
def window(request: pytest.FixtureRequest) -> int:
    return request.param


_WORLDS: dict[int, list] = {}


def _torch_dist(scenario: str, window: int) -> tuple[dict, dict]:
    from adapters.transport.launch import launch_world

    if window not in _WORLDS:
        results = launch_world(world_rank, 2, (window,), timeout_s=60)
        assert all(r.ok for r in results), [(r.error, r.traceback) for r in results]
        _WORLDS[window] = [r.value for r in results]
    i = SCENARIOS.index(scenario)
    return _WORLDS[window][0][i], _WORLDS[window][1][i]


ADAPTERS = [
    pytest.param(_inprocess, id="inprocess"),
    pytest.param(_torch_dist, id="torch_dist", marks=pytest.mark.distributed),
]


@pytest.mark.parametrize("run", ADAPTERS)
def test_stream_arrives_in_order_and_intact(run: Any, window: int) -> None:
    sent, got = run("order", window)
    stream = _stream()
    assert "error" not in sent and "error" not in got, (sent, got)
    assert [i for i, _ in got["seen"]] == list(range(sent["buckets"]))
    assert [last for _, last in got["seen"]] == [False] * (sent["buckets"] - 1) + [True]
    assert got["hashes"] == {n: _hash(t) for n, t in stream}
    assert got["payload"] == sent["payload"] == sum(t.numel() * t.element_size() for _, t in stream)


@pytest.mark.parametrize("run", ADAPTERS)
def test_source_failure_aborts_receivers(run: Any, window: int) -> None:
    sent, got = run("source_fails", window)
    assert sent["error"] == "ValueError"
    assert got["error"] == "TransportAborted" and "quantizing t11 failed" in got["text"]


@pytest.mark.parametrize("run", ADAPTERS)
def test_consumer_failure_drains_then_raises(run: Any, window: int) -> None:
    sent, got = run("consumer_fails", window)
    assert "error" not in sent and sent["buckets"] > 2  # the source finished its stream
    assert got["error"] == "RuntimeError" and [i for i, _ in got["seen"]] == [0, 1]


@pytest.mark.parametrize("run", ADAPTERS)
def test_kept_buckets_stay_intact_in_the_receivers_own_buffers(run: Any, window: int) -> None:
    sent, got = run("keep", window)
    assert "error" not in got and got["buckets"] == sent["buckets"]
    assert got["hashes"] == {n: _hash(t) for n, t in _stream()}
