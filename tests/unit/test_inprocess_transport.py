"""InProcessTransport: zero-copy handoff between two threads, bounded buffers in flight."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from adapters.distributed.inprocess import InProcessTransport
from domain.errors import CollectiveTimeout, TransportAborted
from domain.refit.buckets import Bucket, BucketPlanner, unpack_bucket


def _stream(n: int = 40) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = [(f"t{i}", torch.randn(300 + 17 * i, generator=g).to(torch.bfloat16)) for i in range(n)]
    out.insert(n // 2, ("big", torch.randn(5000, generator=g)))  # larger than a bucket: travels alone
    return out


def _run(transport: InProcessTransport, send_items, consume):
    box: dict[str, object] = {}

    def receiver() -> None:
        try:
            box["recv"] = transport.receive(consume)
        except Exception as err:
            box["recv_error"] = err

    th = threading.Thread(target=receiver)
    th.start()
    try:
        box["send"] = transport.send(send_items)
    except Exception as err:
        box["send_error"] = err
    th.join(timeout=30)
    assert not th.is_alive()
    return box


@pytest.mark.parametrize("window", [1, 2])
def test_buckets_arrive_in_order_intact_with_rotating_buffers(window: int) -> None:
    stream = _stream()
    planner = BucketPlanner(4096, reuse_buffer=True, buffers=window)
    produced, got, indices, in_flight = [0], {}, [], []
    consumed = [0]

    def counted():
        for b in planner.pack(stream):
            produced[0] += 1
            in_flight.append(produced[0] - consumed[0])
            yield b

    def consume(b: Bucket) -> None:
        time.sleep(0.002)  # a slow receiver: the sender must not overwrite what it reads
        indices.append(b.index)
        for name, view in unpack_bucket(b):
            got[name] = view.clone()
        consumed[0] += 1

    box = _run(InProcessTransport(window=window, timeout_s=60), counted(), consume)
    assert "send_error" not in box and "recv_error" not in box, box
    assert indices == list(range(len(indices))) and len(indices) > 5
    assert all(torch.equal(got[n], t) for n, t in stream) and len(got) == len(stream)
    assert max(in_flight) <= window  # never more buckets out than buffers
    assert box["send"].buckets == box["recv"].buckets == len(indices)
    assert box["send"].payload_bytes == sum(t.numel() * t.element_size() for _, t in stream)


def test_receiver_sees_the_senders_buffer_without_a_copy() -> None:
    bucket = next(BucketPlanner(1 << 16, reuse_buffer=True).pack([("w", torch.ones(8))]))
    seen = []
    _run(InProcessTransport(), [bucket], lambda b: seen.append(b.buffer.data_ptr()))
    assert seen == [bucket.buffer.data_ptr()]


def test_source_failure_aborts_the_receiver() -> None:
    def failing():
        yield from BucketPlanner(4096).pack(_stream(4))
        raise ValueError("export of layer 3 failed")

    box = _run(InProcessTransport(timeout_s=60), failing(), lambda b: None)
    assert isinstance(box["send_error"], ValueError)
    assert isinstance(box["recv_error"], TransportAborted) and "export of layer 3 failed" in str(box["recv_error"])


def test_consumer_failure_drains_the_stream_then_raises() -> None:
    seen = []

    def consume(b: Bucket) -> None:
        seen.append(b.index)
        if b.index == 1:
            raise RuntimeError("engine load failed")

    buckets = list(BucketPlanner(4096).pack(_stream(20)))
    box = _run(InProcessTransport(timeout_s=60), iter(buckets), consume)
    assert "send_error" not in box and box["send"].buckets == len(buckets)  # the sender finished
    assert isinstance(box["recv_error"], RuntimeError) and seen == [0, 1]  # nothing consumed after it


def test_silent_peers_time_out() -> None:
    with pytest.raises(CollectiveTimeout, match=r"in-process receiver: timed out after 0\.2 s at step .bucket 0."):
        InProcessTransport(timeout_s=0.2).receive(lambda b: None)
    bucket = next(BucketPlanner(1024).pack([("w", torch.ones(4))]))
    with pytest.raises(CollectiveTimeout, match="acknowledgement of bucket 0"):
        InProcessTransport(window=1, timeout_s=0.2).send([bucket, bucket])


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window"):
        InProcessTransport(window=0)


@pytest.mark.parametrize("window", [1, 2])
def test_double_buffering_packs_the_next_bucket_while_this_one_is_consumed(window: int) -> None:
    """Structural, not timed: with window 2 the consumer of bucket k can wait until the sender has
    started producing bucket k+1; with window 1 bucket k+1 is produced only after k is released."""
    stream = _stream(30)
    started: dict[int, threading.Event] = {}
    released: list[int] = []
    order: list[tuple[str, int]] = []

    def produce():
        for b in BucketPlanner(4096, reuse_buffer=True, buffers=window).pack(stream):
            order.append(("produced", b.index))
            started.setdefault(b.index, threading.Event()).set()
            yield b

    def consume(b: Bucket) -> None:
        if window == 2 and b.index + 1 < 5:
            assert started.setdefault(b.index + 1, threading.Event()).wait(timeout=60), "no overlap"
        order.append(("released", b.index))
        released.append(b.index)

    box = _run(InProcessTransport(window=window, timeout_s=60), produce(), consume)
    assert "send_error" not in box and "recv_error" not in box, box
    produced_at = {i: order.index(("produced", i)) for _, i in order if ("produced", i) in order}
    released_at = {i: order.index(("released", i)) for i in released}
    pairs = [k for k in released_at if k + 1 in produced_at]
    if window == 1:
        assert all(produced_at[k + 1] > released_at[k] for k in pairs)
    else:
        assert any(produced_at[k + 1] < released_at[k] for k in pairs)


def test_a_receiver_that_keeps_buckets_gets_by_reference_buckets_packed_into_its_own_buffers() -> None:
    stream = _stream()
    transport = InProcessTransport(window=2, timeout_s=60)
    kept: list[Bucket] = []
    box: dict[str, object] = {}
    th = threading.Thread(target=lambda: box.setdefault(
        "recv", transport.receive(kept.append, lambda n: torch.empty(n, dtype=torch.uint8))))
    th.start()
    transport.send(BucketPlanner(4096, by_reference=True).pack(stream))
    th.join(timeout=30)
    assert not th.is_alive() and kept
    assert all(not b.by_reference for b in kept)
    got = dict(x for b in kept for x in unpack_bucket(b))
    assert got.keys() == dict(stream).keys()
    for name, t in stream:
        assert torch.equal(got[name], t) and got[name].data_ptr() != t.data_ptr()
