"""The bucket planner: packing, alignment, the last bucket, zero-copy unpacking, buffer reuse."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from domain.errors import BucketLayoutError
from domain.refit.buckets import (
    DEFAULT_ALIGNMENT,
    Bucket,
    BucketPlanner,
    TensorMeta,
    align_up,
    pack_buckets,
    unpack_bucket,
)

DTYPES = (torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.uint8, torch.int64, torch.float16)


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * dtype.itemsize,), generator=g, dtype=torch.uint8)
    t = raw.view(dtype).reshape(shape)
    if dtype.is_floating_point:  # keep NaN bit patterns out so that == comparisons work
        t = torch.where(torch.isfinite(t.float()), t, torch.zeros((), dtype=dtype))
    return t


def _stream(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[tuple[str, torch.Tensor]]:
    return [(f"t{i}", _tensor(shape, dt, i)) for i, (shape, dt) in enumerate(specs)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_round_trip_is_bit_identical_and_in_order():
    stream = _stream([((64, 32), torch.bfloat16), ((7,), torch.float32), ((16, 16), torch.float8_e4m3fn),
                      ((3, 5), torch.uint8), ((), torch.float32), ((0, 4), torch.bfloat16)])
    buckets = list(pack_buckets(stream, 4096))
    out = [(n, t) for b in buckets for n, t in unpack_bucket(b)]
    assert [n for n, _ in out] == [n for n, _ in stream]
    for (_, a), (_, b) in zip(stream, out, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_bits(a), _bits(b))


def test_buckets_respect_capacity_and_alignment():
    stream = _stream([((100,), torch.float32)] * 10)
    buckets = list(pack_buckets(stream, 1024, alignment=128))
    assert [b.index for b in buckets] == list(range(len(buckets)))
    for b in buckets:
        assert b.nbytes <= 1024
        assert all(m.offset % 128 == 0 for m in b.metas)
    # 400-byte tensors at 128-byte alignment: offsets 0 and 512 fit, a third (at 1024) does not.
    assert [len(b.metas) for b in buckets] == [2] * 5


def test_only_the_final_bucket_is_last():
    buckets = list(pack_buckets(_stream([((256,), torch.float32)] * 5), 2048))
    assert [b.is_last for b in buckets] == [False] * (len(buckets) - 1) + [True]


def test_empty_stream_sends_one_empty_last_bucket():
    (b,) = list(pack_buckets([], 1024))
    assert b.is_last and b.metas == () and b.index == 0 and b.nbytes == 0
    assert list(unpack_bucket(b)) == []


def test_a_tensor_larger_than_a_bucket_travels_alone_without_a_copy():
    big = torch.randn(64, 64)  # 16 KiB
    stream = [("small0", torch.ones(4)), ("big", big), ("small1", torch.zeros(4))]
    buckets = list(pack_buckets(stream, 4096))
    assert [[m.name for m in b.metas] for b in buckets] == [["small0"], ["big"], ["small1"]]
    alone = buckets[1]
    assert alone.buffer.data_ptr() == big.data_ptr() and not alone.is_last
    ((name, view),) = list(unpack_bucket(alone))
    assert name == "big" and torch.equal(view, big)


def test_a_large_tensor_at_the_end_is_the_last_bucket():
    buckets = list(pack_buckets([("a", torch.ones(4)), ("big", torch.randn(2048))], 1024))
    assert [m.name for m in buckets[-1].metas] == ["big"] and buckets[-1].is_last
    assert not buckets[0].is_last


def test_unpacked_tensors_are_views_of_the_buffer():
    (b,) = list(pack_buckets([("a", torch.randn(8, 8)), ("b", torch.randn(3))], 4096))
    start, end = b.buffer.data_ptr(), b.buffer.data_ptr() + b.buffer.numel()
    for _, v in unpack_bucket(b):
        assert start <= v.data_ptr() < end


def test_reused_buffer_is_safe_when_the_receiver_copies_before_acknowledging():
    stream = _stream([((128,), torch.float32)] * 6)
    received = {}
    aliased = {}
    buffers = set()
    for bucket in pack_buckets(stream, 1024, reuse_buffer=True):
        buffers.add(bucket.buffer.data_ptr())
        for name, view in unpack_bucket(bucket):
            received[name] = view.clone()  # the receiver copies, then acknowledges
            aliased[name] = view  # a receiver that kept views would see them overwritten
    assert len(buffers) == 1
    for name, t in stream:
        assert torch.equal(received[name], t)
    assert not all(torch.equal(aliased[n], t) for n, t in stream)


def test_non_contiguous_input_is_packed_by_value():
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8).t()
    ((_, v),) = list(unpack_bucket(next(pack_buckets([("t", t)], 1024))))
    assert torch.equal(v, t)


def test_duplicate_names_are_rejected():
    with pytest.raises(BucketLayoutError, match="'x' appears twice"):
        list(pack_buckets([("x", torch.ones(2)), ("x", torch.ones(2))], 1024))


@pytest.mark.parametrize(("bucket_bytes", "alignment"), [(100, 256), (1024, 3), (1024, 0)])
def test_bad_planner_settings_are_rejected(bucket_bytes, alignment):
    with pytest.raises(BucketLayoutError):
        BucketPlanner(bucket_bytes, alignment)


def test_metadata_is_validated():
    with pytest.raises(BucketLayoutError, match="nbytes"):
        TensorMeta("w", (2, 2), torch.float32, 0, 8)
    with pytest.raises(BucketLayoutError, match="offset"):
        TensorMeta("w", (2,), torch.float32, 2, 8)
    a = TensorMeta("a", (4,), torch.float32, 0, 16)
    b = TensorMeta("b", (4,), torch.float32, 8, 16)
    with pytest.raises(BucketLayoutError, match="overlaps"):
        Bucket(0, torch.empty(64, dtype=torch.uint8), (a, b), True)
    with pytest.raises(BucketLayoutError, match="buffer holds"):
        Bucket(0, torch.empty(8, dtype=torch.uint8), (a,), True)
    with pytest.raises(BucketLayoutError, match="flat uint8"):
        Bucket(0, torch.empty(8), (), True)


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.lists(st.integers(0, 40), min_size=0, max_size=3), st.sampled_from(DTYPES)), max_size=12
    ),
    bucket_bytes=st.sampled_from([256, 512, 1000, 4096]),
    alignment=st.sampled_from([8, 64, DEFAULT_ALIGNMENT]),
)
def test_packing_invariants(specs, bucket_bytes, alignment):
    if bucket_bytes < alignment:
        bucket_bytes = alignment
    stream = _stream([(tuple(s), dt) for s, dt in specs])
    buckets = list(pack_buckets(stream, bucket_bytes, alignment=alignment))
    assert sum(b.is_last for b in buckets) == 1 and buckets[-1].is_last
    assert [b.index for b in buckets] == list(range(len(buckets)))
    names = [m.name for b in buckets for m in b.metas]
    assert names == [n for n, _ in stream]
    for b in buckets:
        assert all(m.offset % alignment == 0 for m in b.metas)
        if len(b.metas) > 1:
            assert b.nbytes <= bucket_bytes
        if b.nbytes > bucket_bytes:
            assert len(b.metas) == 1  # only a lone tensor may exceed the capacity
    unpacked = dict(kv for b in buckets for kv in unpack_bucket(b))
    for n, t in stream:
        assert torch.equal(_bits(unpacked[n]), _bits(t))
    # Greedy: a bucket is closed only when the next tensor does not fit at its aligned offset.
    for b, nxt in itertools.pairwise(buckets):
        if b.metas and nxt.metas:
            need = align_up(b.nbytes, alignment) + nxt.metas[0].nbytes
            assert need > bucket_bytes


def test_lead_room_in_front_of_every_packed_bucket_and_none_for_lone_tensors():
    stream = _stream([((300,), torch.float32)] * 6 + [((5000,), torch.float32)] + [((10,), torch.bfloat16)])
    buckets = list(BucketPlanner(4096, alignment=256, lead_bytes=200).pack(stream))
    lone = [b for b in buckets if b.metas[0].nbytes > 4096]
    assert len(lone) == 1 and lone[0].metas[0].offset == 0  # its own bytes, no room, no copy
    for b in buckets:
        if b not in lone:
            assert b.metas[0].offset == 256 and b.nbytes <= 4096  # the lead, aligned up
    out = [x for b in buckets for x in unpack_bucket(b)]
    assert [n for n, _ in out] == [n for n, _ in stream]
    assert all(torch.equal(_bits(a), _bits(c)) for (_, a), (_, c) in zip(stream, out, strict=True))
    with pytest.raises(BucketLayoutError, match="lead_bytes"):
        BucketPlanner(4096, lead_bytes=4096)


def test_by_reference_buckets_group_alike_copy_nothing_and_pack_to_the_same_bytes():
    stream = _stream([((300,), torch.float32)] * 5 + [((5000,), torch.float32), ((7, 3), torch.bfloat16), ((), torch.float32)])
    stream.append(("strided", torch.arange(64, dtype=torch.float32).reshape(8, 8).t()))
    packed = list(BucketPlanner(4096).pack(stream))
    by_ref = list(BucketPlanner(4096, by_reference=True).pack(stream))
    assert [b.metas for b in by_ref] == [b.metas for b in packed]
    assert [b.is_last for b in by_ref] == [b.is_last for b in packed]
    assert all(b.by_reference and b.retained and b.buffer.numel() == 0 for b in by_ref)
    out = dict(x for b in by_ref for x in unpack_bucket(b))
    for name, t in stream:
        if t.is_contiguous():
            assert out[name].data_ptr() == t.data_ptr()  # the tensor itself, not a copy
        assert torch.equal(out[name], t)
    for a, b in zip(by_ref, packed, strict=True):  # packing later gives the packed planner's tensor bytes
        pairs = zip(unpack_bucket(a.packed()), unpack_bucket(b), strict=True)
        assert all(na == nb and torch.equal(_bits(x), _bits(y)) for (na, x), (nb, y) in pairs)


def test_a_by_reference_bucket_must_match_its_entries():
    meta = TensorMeta("a", (4,), torch.float32, 0, 16)
    with pytest.raises(BucketLayoutError, match=r"by reference is torch\.bfloat16"):
        Bucket(0, torch.empty(0, dtype=torch.uint8), (meta,), True, tensors=(torch.zeros(4, dtype=torch.bfloat16),))
    with pytest.raises(BucketLayoutError, match="2 tensors by reference for 1 entries"):
        Bucket(0, torch.empty(0, dtype=torch.uint8), (meta,), True, tensors=(torch.zeros(4), torch.zeros(4)))
