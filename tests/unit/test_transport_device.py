"""The torch.distributed transport with its streams on a GPU, run on the instrumented device
(tests/fake_device.py) over a gloo side group whose broadcasts demand what NCCL demands: every
tensor of a stream (control messages, metadata, END and ABORT, receive buffers) on the transport's
device, and no host buffer on the way."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from adapters.distributed.side_group import SideGroup
from adapters.distributed.transport import TorchDistTransport
from domain.errors import TransportAborted
from domain.refit.buckets import BucketPlanner, unpack_bucket
from tests.fake_device import FakeCuda, on_fake, require_on_device

BUCKET = 1 << 14


class NcclLikeGroup(SideGroup):
    """A gloo side group whose broadcasts accept only tensors on the (fake) GPU."""

    def broadcast_async(self, tensor: torch.Tensor, root: int) -> Any:
        require_on_device(tensor, f"rank {self.rank}: broadcast from {root}")
        return super().broadcast_async(tensor, root)


def _groups() -> tuple[NcclLikeGroup, NcclLikeGroup]:
    rv, store = SideGroup.serve("127.0.0.1", 2, timeout_s=30)
    out: dict[int, SideGroup] = {}
    joiner = threading.Thread(target=lambda: out.__setitem__(1, SideGroup.join(rv, 1)))
    joiner.start()
    out[0] = SideGroup.join(rv, 0, store)
    joiner.join(60)
    return tuple(NcclLikeGroup(g.rendezvous, g.rank, g.pg, g.store) for g in (out[0], out[1]))  # type: ignore[return-value]


def _named(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    sizes = (300, 2000, 9000, 64, 700)  # 9000 bf16 = a lone tensor larger than a bucket
    return [(f"layer{i}.weight", torch.randn(n, generator=g, device="cuda").to(torch.bfloat16))
            for i, n in enumerate(sizes)]


def _run(source_fn, receiver_fn) -> list[Any]:
    results: list[Any] = [None, None]

    def wrap(i: int, fn) -> None:
        try:
            with FakeCuda(host_buffers="forbid"):
                results[i] = fn()
        except BaseException as err:
            results[i] = err

    t = threading.Thread(target=wrap, args=(1, receiver_fn))
    t.start()
    wrap(0, source_fn)
    t.join(120)
    assert not t.is_alive()
    return results


@pytest.mark.parametrize("window", [1, 2])
def test_streams_on_the_gpu_never_touch_the_host(window):
    src_group, dst_group = _groups()
    source = TorchDistTransport(src_group, 0, 0, (0, 1), bucket_bytes=BUCKET, timeout_s=60, window=window, device="cuda")
    receiver = TorchDistTransport(dst_group, 0, 1, (0, 1), bucket_bytes=BUCKET, timeout_s=60, window=window, device="cuda")
    planner = BucketPlanner(BUCKET, reuse_buffer=True, buffers=window, lead_bytes=256)
    for refit in (1, 2):  # the first stream learns the layout, the second follows it
        source.refit_id = receiver.refit_id = refit
        got: dict[str, torch.Tensor] = {}

        def consume(bucket, got=got) -> None:
            assert on_fake(bucket.buffer)
            got.update((n, t.clone()) for n, t in unpack_bucket(bucket))

        with FakeCuda():
            named = _named(refit)
        sent, received = _run(lambda named=named: source.send(planner.pack(named)),
                              lambda consume=consume: receiver.receive(consume))
        assert not isinstance(sent, BaseException), sent
        assert not isinstance(received, BaseException), received
        assert list(got) == [n for n, _ in named]
        for n, t in named:
            assert on_fake(got[n]) and torch.equal(got[n].view(torch.uint8), t.view(torch.uint8)), n


@pytest.mark.parametrize("known_layout", [False, True])
def test_an_abort_travels_on_the_gpu(known_layout):
    src_group, dst_group = _groups()
    source = TorchDistTransport(src_group, 0, 0, (0, 1), bucket_bytes=BUCKET, timeout_s=60, device="cuda")
    receiver = TorchDistTransport(dst_group, 0, 1, (0, 1), bucket_bytes=BUCKET, timeout_s=60, device="cuda")
    planner = BucketPlanner(BUCKET, reuse_buffer=True, buffers=2, lead_bytes=256)
    if known_layout:
        with FakeCuda():
            named = _named(1)
        _run(lambda: source.send(planner.pack(named)), lambda: receiver.receive(lambda b: None))

    def failing():
        for k, bucket in enumerate(planner.pack(named)):
            if k == 2:  # bucket 2 of the layout is the lone large tensor: its abort travels in two messages
                raise RuntimeError("the exporter failed")
            yield bucket

    with FakeCuda():
        named = _named(2)
    sent, received = _run(lambda: source.send(failing()), lambda: receiver.receive(lambda b: None))
    assert isinstance(sent, RuntimeError) and "exporter failed" in str(sent)
    assert isinstance(received, TransportAborted) and "exporter failed" in str(received)


def test_the_shared_memory_ring_from_a_gpu_trainer_crosses_the_host_through_pinned_buffers():
    from tests.refit_support import shm_pair

    source, (receiver,) = shm_pair(1, bucket_bytes=BUCKET, slot_bytes=4096, timeout_s=30)
    assert BucketPlanner(BUCKET).device is None
    planner = BucketPlanner(BUCKET, reuse_buffer=True, buffers=1, device=source.device)  # the ring is on the host
    got: dict[str, torch.Tensor] = {}
    rx = threading.Thread(target=lambda: receiver.receive(lambda b: got.update((n, t.clone()) for n, t in unpack_bucket(b))))
    rx.start()
    with FakeCuda(host_buffers="pinned") as mode:  # an unpinned host buffer on the trainer's side fails
        named = _named(4)
        source.send(planner.pack(named))
        assert mode.synchronized >= 3  # each bucket's copies out of the GPU completed before it went on
        mode.host_buffers = "allow"  # the check's own copies
        expected = {n: t.to("cpu") for n, t in named}
    rx.join(60)
    source.close()
    receiver.close()
    assert list(got) == list(expected) and all(torch.equal(got[n], t) for n, t in expected.items())


def test_the_collectives_device_follows_the_backend(monkeypatch):
    from adapters.distributed.collectives import backend_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # the rank's GPU, as NCCL ranks set it
    assert backend_device("nccl") == torch.device("cuda", 1)
    assert backend_device("gloo") == torch.device("cpu")
