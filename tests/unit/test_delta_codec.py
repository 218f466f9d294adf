"""The delta codec: records round-trip bit for bit in every stored dtype, the smaller index coding
is chosen, digests tell bytes, dtypes and shapes apart, and a record refuses a base it was not made
against, a corrupted base and malformed bytes, naming the tensor."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from domain.errors import DeltaBaseMismatch, DeltaRecordError
from domain.refit.delta import (
    DELTA_SUFFIX,
    HEADER_BYTES,
    Coding,
    DeltaRecord,
    apply,
    diff,
    patch_,
    state_digest,
    tensor_digest,
)
from domain.refit.delta_sync import DeltaReceiver, DeltaSender

DTYPES = [torch.float8_e4m3fn, torch.uint8, torch.bfloat16, torch.float32]


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (torch.Size(shape).numel() * dtype.itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def _flip(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`t` with the elements at flat `index` changed (their lowest byte's low bit flipped)."""
    out = t.clone()
    out.reshape(-1).view(torch.uint8).view(-1, t.element_size())[index, 0] ^= 1
    return out


def _diff(base: torch.Tensor, new: torch.Tensor) -> DeltaRecord | None:
    return diff(base, new, base_digest=tensor_digest(base), new_digest=tensor_digest(new))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_record_round_trips_bit_for_bit(dtype):
    base = _random((64, 96), dtype, 0)
    new = _flip(base, torch.tensor([0, 5, 6, 7, 4000, 6143]))
    record = _diff(base, new)
    assert record is not None and record.count == 6
    sent = record.to_tensor()
    assert sent.dtype == torch.uint8 and sent.dim() == 1 and sent.numel() == record.nbytes
    out = apply("w", base, DeltaRecord.from_tensor("w", sent))
    assert out.dtype == dtype and out.shape == new.shape and torch.equal(_bytes(out), _bytes(new))


def test_bits_not_values_are_compared():
    base = torch.tensor([0.0, 1.0, float("nan")] * 64, dtype=torch.float32)
    new = base.clone()
    new[0] = -0.0  # equal as a value, another bit pattern
    record = _diff(base, new)
    assert record is not None and record.count == 1  # NaN == NaN bit for bit: unchanged
    assert torch.equal(_bytes(apply("w", base, record)), _bytes(new))


def test_the_smallest_index_coding_is_chosen():
    base = _random((1 << 20,), torch.uint8, 1)
    clustered = _diff(base, _flip(base, torch.arange(100, 140)))
    dense = _diff(base, _flip(base, torch.arange(0, 1 << 20, 3)))
    scattered = _diff(base, _flip(base, torch.arange(0, 1 << 20, 50)))  # gaps of 49: one byte each
    sparse = _diff(base, _flip(base, torch.arange(0, 1 << 20, 1000)))  # gaps of 999: 2 bytes, not 4
    assert clustered.coding is Coding.RUNS32 and clustered.runs == 1
    assert clustered.nbytes == HEADER_BYTES + 8 + 40  # one (start, length) pair, 40 new bytes
    assert dense.coding is Coding.BITMAP and dense.nbytes == HEADER_BYTES + (1 << 17) + dense.count
    assert scattered.coding is Coding.GAPS8 and scattered.runs == scattered.count
    assert sparse.coding is Coding.GAPS16 and sparse.nbytes == HEADER_BYTES + _pad8(2 * sparse.count) + sparse.count
    for record, new_index in ((scattered, torch.arange(0, 1 << 20, 50)), (sparse, torch.arange(0, 1 << 20, 1000))):
        assert torch.equal(_bytes(apply("w", base, record)), _bytes(_flip(base, new_index)))


@pytest.mark.parametrize("index", [[0], [65534], [65535], [70000, 70001, 299999], [254, 255, 256, 600]])
@pytest.mark.parametrize("coding", [Coding.GAPS8, Coding.GAPS16, Coding.RUNS32])
def test_every_index_coding_round_trips_long_gaps(index, coding):
    import domain.refit.delta as codec

    base = torch.zeros(300_000, dtype=torch.uint8)
    new = _flip(base, torch.tensor(index))
    record = _diff(base, new)
    idx = torch.tensor(index)
    if coding is Coding.RUNS32:
        starts, lengths = codec._runs(idx)
        coded, runs = torch.cat([starts, lengths]).to(torch.int32).view(torch.uint8), starts.numel()
    else:
        coded = codec._encode_gaps(idx, coding)
        runs = coded.numel() // (1 if coding is Coding.GAPS8 else 2)
    forced = attrs.evolve(record, coding=coding, index=coded, runs=runs)
    assert torch.equal(apply("w", base, DeltaRecord.from_tensor("w", forced.to_tensor())), new)


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def test_a_tensor_that_changed_too_much_goes_whole():
    base = _random((1024,), torch.float8_e4m3fn, 2)
    assert _diff(base, _flip(base, torch.arange(1024))) is None
    assert _diff(base[:8], _flip(base[:8], torch.tensor([0]))) is None  # smaller than a header
    record = _diff(base, base.clone())
    assert record is not None and record.count == 0 and record.nbytes == HEADER_BYTES


def test_digests_tell_bytes_dtype_and_shape_apart():
    t = _random((8, 16), torch.uint8, 3)
    assert tensor_digest(t) == tensor_digest(t.clone()) and len(tensor_digest(t)) == 16
    assert tensor_digest(t) != tensor_digest(_flip(t, torch.tensor([77])))
    assert tensor_digest(t) != tensor_digest(t.view(torch.int8))
    assert tensor_digest(t) != tensor_digest(t.reshape(16, 8))
    assert tensor_digest(t.t()) == tensor_digest(t.t().contiguous())
    assert state_digest({}) is None
    assert state_digest({"a": b"1", "b": b"2"}) == state_digest({"b": b"2", "a": b"1"}) != state_digest({"a": b"1"})


def test_a_record_refuses_another_base_naming_the_tensor():
    base = _random((256,), torch.float8_e4m3fn, 4)
    record = _diff(base, _flip(base, torch.tensor([3])))
    other = _flip(base, torch.tensor([9]))
    with pytest.raises(DeltaBaseMismatch, match=r"tensor 'layers.0.w'.*applies to base"):
        patch_("layers.0.w", other.clone(), record, tensor_digest(other))


def test_a_corrupted_base_is_detected_after_the_patch():
    base = _random((256,), torch.float8_e4m3fn, 5)
    record = _diff(base, _flip(base, torch.tensor([3])))
    corrupted = _flip(base, torch.tensor([200]))  # its digest is stale: the receiver's cached one
    with pytest.raises(DeltaBaseMismatch, match=r"tensor 'w'.*base copy was corrupted"):
        patch_("w", corrupted, record, tensor_digest(base))


def test_a_record_refuses_a_base_of_another_size():
    base = _random((256,), torch.uint8, 6)
    record = _diff(base, _flip(base, torch.tensor([3])))
    small = base[:128].clone()
    with pytest.raises(DeltaBaseMismatch, match="does not fit"):
        patch_("w", small, attrs.evolve(record, base_digest=tensor_digest(small)), tensor_digest(small))


@pytest.mark.parametrize(("mutate", "match"), [
    (lambda r: r[:-1], "header says"),
    (lambda r: torch.cat([torch.tensor([0], dtype=torch.uint8), r[1:]]), "bad header"),
    (lambda r: r[:10], "at least 64 bytes"),
    (lambda r: r.view(torch.int8), "flat uint8"),
])
def test_malformed_records_are_refused_naming_the_tensor(mutate, match):
    base = _random((256,), torch.uint8, 7)
    sent = _diff(base, _flip(base, torch.tensor([3]))).to_tensor()
    with pytest.raises(DeltaRecordError, match=rf"delta record of 'w'.*{match}|{match}"):
        DeltaRecord.from_tensor("w", mutate(sent))


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(numel=st.integers(1, 3000), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
       fraction=st.floats(0.0, 1.0))
def test_property_delta_or_whole_always_reproduces_the_new_bytes(numel, dtype, seed, fraction):
    base = _random((numel,), dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    index = (torch.rand(numel, generator=g) < fraction).nonzero().reshape(-1)
    new = _flip(base, index)
    record = _diff(base, new)
    if record is None:  # whole: never larger than the tensor itself
        return
    assert record.nbytes < numel * dtype.itemsize
    out = apply("w", base, DeltaRecord.from_tensor("w", record.to_tensor()))
    assert torch.equal(_bytes(out), _bytes(new))


def test_sender_and_receiver_keep_equal_copies_and_say_why_full():
    from domain.refit.delta_sync import DeltaBase

    sender, receiver = DeltaSender(full_every=5), DeltaReceiver()
    stream = [("a.weight", _random((512,), torch.float8_e4m3fn, 8)), ("a.weight_scale", torch.ones(4))]
    assert "first refit" in sender.begin(receiver.base())
    receiver.begin()
    receiver.receive(sender.stage(stream))
    sender.commit()
    receiver.commit()
    assert sender.digest() == receiver.base().digest is not None
    stream2 = [("a.weight", _flip(stream[0][1], torch.tensor([1]))), stream[1]]
    assert sender.begin(receiver.base()) is None
    sent = list(sender.stage(stream2))
    assert [n for n, _ in sent] == ["a.weight" + DELTA_SUFFIX, "a.weight_scale"]  # 16 bytes: whole
    receiver.begin()
    got = dict(receiver.receive(sent))
    assert torch.equal(_bytes(got["a.weight"]), _bytes(stream2[0][1]))
    assert "differs" in sender.begin(DeltaBase(digest="0" * 32))
