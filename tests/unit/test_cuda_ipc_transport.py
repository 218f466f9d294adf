"""The CUDA IPC transport's logic on a CPU: the ring lives on the instrumented device
(tests/fake_device.py) and is handed to the receivers in-process instead of through an IPC handle.
What runs is the transport itself: the double buffer, the shared-memory ring's frames, the waits
for the GPU before a slot is announced and before it is released, and no host buffer."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from adapters.distributed.cuda_ipc_transport import CudaIpcSource, connect
from adapters.distributed.transports import join_transport, offer_transport
from domain.errors import ConfigError, TransportAborted
from domain.refit.buckets import BucketPlanner, unpack_bucket
from tests.fake_device import FakeCuda, on_fake

BUCKET = 1 << 14


class InProcessSharing:
    """RingSharing within one process: the handle is a key to the tensor itself."""

    def __init__(self) -> None:
        self.rings: dict[str, torch.Tensor] = {}

    def export(self, ring: torch.Tensor) -> str:
        key = f"ring-{len(self.rings)}"
        self.rings[key] = ring
        return key

    def open(self, handle: str) -> torch.Tensor:
        return self.rings[handle]


def _named(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    sizes = (300, 2000, 9000, 64, 700)  # 9000 bf16: a lone tensor larger than a slot
    return [(f"layer{i}.weight", torch.randn(n, generator=g, device="cuda").to(torch.bfloat16))
            for i, n in enumerate(sizes)]


def _stream(receivers: int, by_reference: bool, fail_after: int | None = None) -> tuple[Any, list[Any], list[int]]:
    sharing = InProcessSharing()
    fences: list[int] = []
    with FakeCuda(host_buffers="forbid") as mode:
        source = CudaIpcSource.serve(receivers, BUCKET, "cuda", timeout_s=30, sharing=sharing)
        ends = [connect(source.rendezvous, r, BUCKET, sharing) for r in range(1, receivers + 1)]
        sender = source.accept()
        assert on_fake(sender.ring) and sender.device.type == "cuda" and sender.slots == 2
        named = _named(3)
    results: list[Any] = [None] * receivers

    def receive(i: int) -> None:
        got: dict[str, torch.Tensor] = {}

        def consume(bucket) -> None:
            assert on_fake(bucket.buffer)
            got.update((n, t.clone()) for n, t in unpack_bucket(bucket))

        try:
            with FakeCuda(host_buffers="forbid") as rx_mode:
                ends[i].receive(consume)
                fences.append(rx_mode.synchronized)
            results[i] = got
        except BaseException as err:
            results[i] = err

    threads = [threading.Thread(target=receive, args=(i,)) for i in range(receivers)]
    for t in threads:
        t.start()

    def buckets():
        for k, b in enumerate(BucketPlanner(BUCKET, by_reference=by_reference).pack(named)):
            if k == fail_after:
                raise RuntimeError("the exporter failed")
            yield b

    try:
        with FakeCuda(host_buffers="forbid") as mode:
            sent: Any = sender.send(buckets())
            fences.insert(0, mode.synchronized)
    except RuntimeError as err:
        sent = err
    for t in threads:
        t.join(60)
    for end in (sender, *ends):
        end.close()
    return (sent, named), results, fences


@pytest.mark.parametrize("by_reference", [False, True])
def test_buckets_cross_the_gpu_ring_bit_for_bit_and_wait_for_the_gpu(by_reference):
    (sent, named), results, fences = _stream(2, by_reference)
    assert not isinstance(sent, BaseException), sent
    for got in results:
        assert not isinstance(got, BaseException), got
        assert list(got) == [n for n, _ in named]
        for n, t in named:
            assert on_fake(got[n]) and torch.equal(got[n].view(torch.uint8), t.view(torch.uint8)), n
    with FakeCuda(host_buffers="allow"):
        slots_filled = sum(-(-b.nbytes // BUCKET) for b in BucketPlanner(BUCKET).pack(named))
    assert fences[0] >= slots_filled  # the source waited before announcing each slot
    assert all(f >= slots_filled for f in fences[1:])  # each receiver waited before releasing each slot


def test_an_abort_reaches_every_receiver():
    (sent, _), results, _ = _stream(2, by_reference=False, fail_after=1)
    assert isinstance(sent, RuntimeError)
    assert all(isinstance(r, TransportAborted) and "exporter failed" in str(r) for r in results)


def test_transports_by_name_on_both_ends():
    offer = offer_transport("shm", 1, BUCKET, slot_bytes=4096, timeout_s=30)
    receiver = join_transport("shm", offer.rendezvous, 1, BUCKET)
    sender = offer.accept()
    g = torch.Generator().manual_seed(0)
    named = [(f"t{i}", torch.randn(500 * (i + 1), generator=g)) for i in range(4)]
    got: dict[str, torch.Tensor] = {}
    rx = threading.Thread(target=lambda: receiver.transport.receive(
        lambda b: got.update((n, t.clone()) for n, t in unpack_bucket(b))))
    rx.start()
    sender.transport.send(BucketPlanner(BUCKET).pack(named))
    rx.join(60)
    sender.close()
    receiver.close()
    assert all(torch.equal(got[n], t) for n, t in named)


def test_an_unknown_transport_name_names_the_key():
    with pytest.raises(ConfigError, match="resolve auto") as info:
        offer_transport("auto", 1, BUCKET)
    assert info.value.key == "transport"
