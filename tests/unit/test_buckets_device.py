"""The bucket planner on a GPU's tensors, run on the instrumented device (tests/fake_device.py):
buckets live on their tensors' device, by-reference buckets copy nothing, host-crossing buckets are
pinned, buffers are allocated once across refits, and no bucket mixes devices."""

from __future__ import annotations

import pytest
import torch

from domain.refit.buckets import BucketPlanner, unpack_bucket
from tests.fake_device import FakeCuda, on_fake

BUCKET = 8192


def _stream(device: str, sizes: tuple[int, ...] = (300, 700, 5000, 64, 900)) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(f"t{i}", torch.randn(n, generator=g, device=device).to(torch.bfloat16)) for i, n in enumerate(sizes)]


def _allocated(mode: FakeCuda) -> int:
    """Host tensors of one byte or more created so far (an empty placeholder allocates nothing)."""
    return sum(1 for _, nbytes, _ in mode.host_created if nbytes)


def _round_trip(named, buckets) -> None:
    got = dict(kv for b in buckets for kv in unpack_bucket(b))
    assert list(got) == [n for n, _ in named]
    for n, t in named:  # compared where they are (a host bucket against a GPU tensor: once copied over)
        expected = t if got[n].device == t.device else t.to(got[n].device)
        assert torch.equal(got[n].view(torch.uint8), expected.view(torch.uint8)), n


@pytest.mark.parametrize("reuse", [False, True])
def test_packed_buckets_live_on_their_tensors_device(reuse):
    with FakeCuda(host_buffers="forbid"):  # a host buffer of a bucket's size fails here
        named = _stream("cuda")
        buckets = [b for b in BucketPlanner(BUCKET, reuse_buffer=reuse).pack(named)]
        assert all(on_fake(b.buffer) for b in buckets if b.nbytes)
        _round_trip(named, buckets) if not reuse else None


def test_a_lone_large_tensor_on_the_buckets_device_is_a_view_of_itself():
    with FakeCuda(host_buffers="forbid"):
        named = _stream("cuda", (100, 10_000, 100))
        buckets = list(BucketPlanner(BUCKET).pack(named))
        lone = [b for b in buckets if b.nbytes > BUCKET]
        assert len(lone) == 1 and lone[0].buffer.data_ptr() == named[1][1].data_ptr()
        _round_trip(named, buckets)


def test_by_reference_buckets_copy_nothing():
    with FakeCuda(host_buffers="forbid") as mode:
        named = _stream("cuda")
        made = _allocated(mode)
        buckets = list(BucketPlanner(BUCKET, by_reference=True).pack(named))
        refs = [t for b in buckets for t in b.tensors]
        assert [t.data_ptr() for t in refs] == [t.data_ptr() for _, t in named]
        assert all(b.device == torch.device("cuda", 0) for b in buckets if b.metas)
        assert _allocated(mode) == made  # no buffer at all


def test_packing_a_bucket_by_reference_stays_on_its_device():
    with FakeCuda(host_buffers="forbid"):
        named = _stream("cuda")
        for b in BucketPlanner(BUCKET, by_reference=True).pack(named):
            if b.metas:
                assert on_fake(b.packed().buffer)


def test_buckets_for_a_host_transport_are_pinned_and_settled():
    with FakeCuda(host_buffers="pinned") as mode:  # an unpinned host buffer fails here
        named = _stream("cuda", (300, 700, 10_000, 64))
        buckets = []
        for b in BucketPlanner(BUCKET, device="cpu").pack(named):
            assert b.buffer.device.type == "cpu" and not on_fake(b.buffer) and b.buffer.is_pinned()
            buckets.append(b)
        mode.host_buffers = "allow"  # the check's own copies
        _round_trip(named, buckets)
        assert mode.synchronized >= len(buckets)  # every bucket's copies completed before it was handed on


def test_reused_buffers_are_allocated_once_across_refits():
    planner = BucketPlanner(BUCKET, reuse_buffer=True, buffers=2)
    with FakeCuda(host_buffers="forbid"):
        named = _stream("cuda")
        first = {b.buffer.data_ptr() for b in planner.pack(named) if b.nbytes <= BUCKET}
        second = {b.buffer.data_ptr() for b in planner.pack(named) if b.nbytes <= BUCKET}
        assert first == second and len(first) == 2


def test_reused_host_buffers_are_allocated_once_across_refits():
    planner = BucketPlanner(BUCKET, reuse_buffer=True, buffers=2, device="cpu")
    with FakeCuda(host_buffers="pinned") as mode:
        named = _stream("cuda", (300, 700, 10_000, 64))
        list(planner.pack(named))
        made = _allocated(mode)
        list(planner.pack(named))
        assert _allocated(mode) == made  # the second refit allocates nothing


def test_no_bucket_mixes_devices():
    with FakeCuda(host_buffers="allow"):
        g = torch.Generator().manual_seed(1)
        named = [("a", torch.randn(100, generator=g)), ("b", torch.randn(100, generator=g).to("cuda")),
                 ("c", torch.randn(5000, generator=g).to("cuda")), ("d", torch.randn(100, generator=g))]
        for by_reference in (False, True):
            for b in BucketPlanner(BUCKET, by_reference=by_reference).pack(named):
                devices = {t.device for t in b.tensors} if by_reference else {b.buffer.device}
                assert len(devices) <= 1
                names = [m.name for m in b.metas]
                on_gpu = {n for n, t in named if t.device.type == "cuda"}
                assert set(names) <= on_gpu or not set(names) & on_gpu
