"""The BucketTransport contract, run against every adapter: in-process (two threads) and
torch.distributed (two processes over gloo on 127.0.0.1, marked distributed).

The shared-memory transport runs every scenario with source and receiver threads of one process,
through rings whose slots are smaller than a bucket and larger than one.

Scenarios: an ordered, intact stream with a tensor larger than a bucket; a source that fails
mid-stream (the receiver gets TransportAborted with the source's error); a receiver whose consumer
fails (it drains the stream, then raises; the source finishes); a receiver that keeps every bucket
in buffers of its own (`allocate`), intact after the stream.

The torch.distributed transport learns a stream's layout from its first complete stream and then
sends each bucket without control messages: its worlds run every scenario both before and after
the layout is known, with planners that leave room for the lead record and planners that do not,
and streams whose layout changes (the source fails with WireProtocolError, the receivers abort,
and the next stream is learned afresh).
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import pytest
import torch

from adapters.distributed.wire import LEAD_BYTES
from domain.refit.buckets import Bucket, BucketPlanner, unpack_bucket

SCENARIOS = ("order", "source_fails", "consumer_fails", "keep")
BUCKET = 8192
# The sequence each torch.distributed world runs, with what each end knows of the layout before it.
SEQUENCE = (
    "order",  # learning
    "order",  # known
    "source_fails",  # known: the abort fills the posted receive of the failing bucket
    "source_fails",  # learning (an abort forgets the layout on both ends)
    "consumer_fails",  # learning: the stream completes, so the layout is learned
    "consumer_fails",  # known
    "keep",  # known
    "shrunk",  # known: the source's stream ends early
    "order",  # learning
    "changed",  # known: a tensor changes shape
    "order",  # learning
    "keep",  # known
    "by_reference",  # known: the source's buckets reference its tensors; the transport packs them
)


def _stream(scenario: str = "order") -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = [(f"t{i}", torch.randn(200 + 31 * i, generator=g).to(torch.bfloat16)) for i in range(30)]
    out.insert(10, ("big", torch.randn(3000, generator=g)))
    if scenario == "shrunk":
        return out[:20]
    if scenario == "changed":
        out[15] = (out[15][0], out[15][1][:-8])
    return out


def _hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def sender(scenario: str, transport: Any, lead_bytes: int = 0) -> dict[str, Any]:
    planner = BucketPlanner(BUCKET, reuse_buffer=True, buffers=transport.window, lead_bytes=lead_bytes,
                            by_reference=scenario == "by_reference")

    def items():
        for i, item in enumerate(_stream(scenario)):
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
    from adapters.distributed.inprocess import InProcessTransport

    t = InProcessTransport(window=window, timeout_s=60)
    box: dict[str, dict] = {}
    th = threading.Thread(target=lambda: box.setdefault("recv", receiver(scenario, t)))
    th.start()
    sent = sender(scenario, t)
    th.join(timeout=30)
    return sent, box["recv"]


def world_rank(rank: int, window: int, lead_bytes: int) -> list[dict[str, Any]]:
    """Rank 0 sends, rank 1 receives, the SEQUENCE in turn (one refit id each)."""
    from adapters.distributed.collectives import TorchDistCollectives
    from domain.refit.topology import RefitWorld

    comm = TorchDistCollectives(RefitWorld(), rank, step_timeout_s=60, phase_timeout_s=60, bucket_bytes=BUCKET,
                                window=window)
    out = []
    for i, scenario in enumerate(SEQUENCE):
        t = comm.transport(0, refit_id=i + 1)
        out.append(sender(scenario, t, lead_bytes) if rank == 0 else receiver(scenario, t))
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["window1", "window2"])
def window(request: pytest.FixtureRequest) -> int:
    return request.param


_WORLDS: dict[tuple[int, int], list] = {}


def _world(window: int, lead_bytes: int) -> list:
    from adapters.distributed.launch import launch_world

    if (window, lead_bytes) not in _WORLDS:
        results = launch_world(world_rank, 2, (window, lead_bytes), timeout_s=90)
        assert all(r.ok for r in results), [(r.error, r.traceback) for r in results]
        _WORLDS[window, lead_bytes] = [r.value for r in results]
    return _WORLDS[window, lead_bytes]


def _torch_dist(scenario: str, window: int) -> list[tuple[dict, dict]]:
    """Every run of `scenario` in the SEQUENCE, with and without lead room."""
    runs = []
    for lead_bytes in (0, LEAD_BYTES):
        sent, got = _world(window, lead_bytes)
        runs += [(sent[i], got[i]) for i, name in enumerate(SEQUENCE) if name == scenario]
    return runs


def _inprocess_runs(scenario: str, window: int) -> list[tuple[dict, dict]]:
    return [_inprocess(scenario, window)]


def _shm_runs(scenario: str, window: int) -> list[tuple[dict, dict]]:
    """A shared-memory ring of `window` slots, smaller than a bucket (buckets cross slots) and
    larger than one (buckets consumed where they lie in the ring), source and receiver threads of
    this process."""
    from tests.refit_support import shm_pair

    runs = []
    for slot_bytes in (BUCKET // 2 - 8, 2 * BUCKET):
        source, (end,) = shm_pair(1, bucket_bytes=BUCKET, slots=window, slot_bytes=slot_bytes, timeout_s=60)
        box: dict[str, dict] = {}
        th = threading.Thread(target=lambda box=box, end=end: box.setdefault("recv", receiver(scenario, end)))
        th.start()
        sent = sender(scenario, source)
        th.join(timeout=30)
        source.close()
        end.close()
        runs.append((sent, box["recv"]))
    return runs


ADAPTERS = [
    pytest.param(_inprocess_runs, id="inprocess"),
    pytest.param(_shm_runs, id="shm"),
    pytest.param(_torch_dist, id="torch_dist", marks=pytest.mark.distributed),
]


@pytest.mark.parametrize("run", ADAPTERS)
def test_stream_arrives_in_order_and_intact(run: Any, window: int) -> None:
    stream = _stream()
    for sent, got in run("order", window):
        assert "error" not in sent and "error" not in got, (sent, got)
        assert [i for i, _ in got["seen"]] == list(range(sent["buckets"]))
        assert [last for _, last in got["seen"]] == [False] * (sent["buckets"] - 1) + [True]
        assert got["hashes"] == {n: _hash(t) for n, t in stream}
        assert got["payload"] == sent["payload"] == sum(t.numel() * t.element_size() for _, t in stream)


@pytest.mark.parametrize("run", ADAPTERS)
def test_source_failure_aborts_receivers(run: Any, window: int) -> None:
    for sent, got in run("source_fails", window):
        assert sent["error"] == "ValueError"
        assert got["error"] == "TransportAborted" and "quantizing t11 failed" in got["text"]


@pytest.mark.parametrize("run", ADAPTERS)
def test_consumer_failure_drains_then_raises(run: Any, window: int) -> None:
    for sent, got in run("consumer_fails", window):
        assert "error" not in sent and sent["buckets"] > 2  # the source finished its stream
        assert got["error"] == "RuntimeError" and [i for i, _ in got["seen"]] == [0, 1]


@pytest.mark.parametrize("run", ADAPTERS)
def test_kept_buckets_stay_intact_in_the_receivers_own_buffers(run: Any, window: int) -> None:
    for sent, got in run("keep", window):
        assert "error" not in got and got["buckets"] == sent["buckets"]
        assert got["hashes"] == {n: _hash(t) for n, t in _stream()}


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", ["shrunk", "changed"])
def test_a_stream_that_leaves_the_known_layout_aborts_on_both_ends(scenario: str, window: int) -> None:
    runs = _torch_dist(scenario, window)
    assert len(runs) == 2  # without and with lead room
    for sent, got in runs:
        assert sent["error"] == "WireProtocolError", sent
        assert "earlier refits" in sent["text"]
        assert got["error"] == "TransportAborted" and "earlier refits" in got["text"], got
    for lead_bytes in (0, LEAD_BYTES):  # and the next stream is learned afresh, intact
        sent, got = _world(window, lead_bytes)
        after = SEQUENCE.index(scenario) + 1
        assert "error" not in got[after] and got[after]["hashes"] == {n: _hash(t) for n, t in _stream()}


@pytest.mark.parametrize("run", [pytest.param(_torch_dist, id="torch_dist", marks=pytest.mark.distributed),
                                 pytest.param(_shm_runs, id="shm")])
def test_by_reference_buckets_are_packed_for_the_wire(run: Any, window: int) -> None:
    for sent, got in run("by_reference", window):
        assert "error" not in sent and "error" not in got, (sent, got)
        assert got["hashes"] == {n: _hash(t) for n, t in _stream()}
