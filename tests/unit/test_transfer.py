"""The transport wire format, rank statuses, failure summaries and the distributed fault vocabulary."""

from __future__ import annotations

import pytest
import torch

from adapters.distributed.wire import (
    LEAD_BYTES,
    STATUS_BYTES,
    FrameKind,
    Header,
    StreamLayout,
    decode_lead,
    decode_metas,
    decode_status,
    encode_lead,
    encode_metas,
    encode_status,
)
from adapters.memory.faults import RankFault
from domain.errors import WireProtocolError
from domain.refit.buckets import TensorMeta
from domain.refit.status import EngineState, RankStatus, failure_summary


def test_header_round_trip_and_checks() -> None:
    h = Header(FrameKind.BUCKET, refit_id=7, index=3, is_last=True, nbytes=1 << 33, meta_len=120)
    assert Header.from_tensor(h.to_tensor(), 7, source=0) == h
    with pytest.raises(WireProtocolError, match="refit 6 while this rank is in refit 7"):
        Header.from_tensor(Header(FrameKind.END, 6).to_tensor(), 7, source=2)
    corrupt = h.to_tensor()
    corrupt[0] = 1
    with pytest.raises(WireProtocolError, match="corrupt frame header from rank 4"):
        Header.from_tensor(corrupt, 7, source=4)


def test_metadata_round_trip_every_dtype() -> None:
    metas = (
        TensorMeta("a.weight", (4, 8), torch.float8_e4m3fn, 0, 32),
        TensorMeta("a.weight_scale", (1, 1), torch.float32, 256, 4),
        TensorMeta("b.weight_packed", (2, 3), torch.uint8, 512, 6),
        TensorMeta("c.weight", (3,), torch.bfloat16, 768, 6),
    )
    assert decode_metas(encode_metas(metas)) == metas
    with pytest.raises(WireProtocolError, match="corrupt bucket metadata"):
        decode_metas(torch.tensor(list(b"[[1,2]]"), dtype=torch.uint8))


def test_status_round_trip_and_truncation() -> None:
    s = RankStatus(3, "engine", engine=EngineState.RESTORED, fingerprint="abcd1234")
    s = s.failed("bucket 2", ValueError("boom"))
    t = encode_status(s)
    assert t.shape == (STATUS_BYTES,) and decode_status(t) == s
    assert s.failed("finalize", "later").step == "bucket 2"  # the first failure is kept
    long = RankStatus(0, "trainer").failed("export x", "E: " + "y" * 5000)
    back = decode_status(encode_status(long))
    assert not back.ok and back.error.startswith("E: yyy") and back.error.endswith("...")


def test_failure_summary_names_the_cause_and_every_engine() -> None:
    statuses = [
        RankStatus(0, "trainer").failed("bucket 1", "TransportAborted: rank 0 aborted"),
        RankStatus(1, "trainer").failed("export q", "InjectedFault: boom"),
        RankStatus(2, "engine", engine=EngineState.KEPT).failed("bucket 1", "TransportAborted: rank 0 aborted"),
        RankStatus(3, "engine", engine=EngineState.RESTORED),
    ]
    text = failure_summary(5, statuses)
    assert text.startswith("refit 5 failed: rank 1 (trainer) at export q: InjectedFault: boom;")
    assert "rank 2 (engine)" not in text and text.endswith("engines: rank 2 kept, rank 3 restored")


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("bucket:2", RankFault(1, "bucket", 2)),
        ("export:0", RankFault(1, "export", 0)),
        ("finalize", RankFault(1, "finalize")),
        ("HANG:verify", RankFault(1, "verify", hang=True)),
        ("hang:bucket:4", RankFault(1, "bucket", 4, hang=True)),
    ],
)
def test_rank_fault_parse(text: str, want: RankFault) -> None:
    got = RankFault.parse(text, rank=1)
    assert got == want and RankFault.parse(str(got), rank=1) == got


@pytest.mark.parametrize("text", ["bucket", "finalize:2", "explode", "bucket:-1", "hang:", "bucket:x"])
def test_rank_fault_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=r"unknown fault"):
        RankFault.parse(text, rank=0)


def test_rank_fault_hits_one_rank_one_refit_one_step() -> None:
    f = RankFault(2, "bucket", 1, refit=3)
    assert f.hits(2, 3, "bucket", 1)
    assert not f.hits(1, 3, "bucket", 1) and not f.hits(2, 2, "bucket", 1) and not f.hits(2, 3, "bucket", 0)


def test_lead_record_round_trip_and_truncated_error_text() -> None:
    h = Header(FrameKind.BUCKET, refit_id=9, index=4, is_last=True, nbytes=1 << 20, layout=0x1234567)
    lead = encode_lead(h)
    assert lead.numel() == LEAD_BYTES
    assert decode_lead(lead, 9, source=0) == (h, "")
    abort = encode_lead(Header(FrameKind.ABORT, 9, 4), "x" * 1000)
    header, text = decode_lead(abort, 9, source=0)
    assert header.kind is FrameKind.ABORT and text == "x" * (LEAD_BYTES - 64)
    with pytest.raises(WireProtocolError, match="out of step"):
        decode_lead(lead, 10, source=0)


def test_stream_layout_digest_is_stable_and_sees_every_field() -> None:
    a = TensorMeta("a.weight", (4, 8), torch.bfloat16, 256, 64)
    layout = StreamLayout(((320, (a,)), (0, ())))
    assert layout.digest == StreamLayout(((320, (a,)), (0, ()))).digest and len(layout) == 2
    changed = [
        StreamLayout(((320, (TensorMeta("b.weight", (4, 8), torch.bfloat16, 256, 64),)), (0, ()))),
        StreamLayout(((320, (TensorMeta("a.weight", (8, 4), torch.bfloat16, 256, 64),)), (0, ()))),
        StreamLayout(((320, (TensorMeta("a.weight", (4, 8), torch.float16, 256, 64),)), (0, ()))),
        StreamLayout(((576, (TensorMeta("a.weight", (4, 8), torch.bfloat16, 512, 64),)), (0, ()))),
        StreamLayout(((320, (a,)),)),
    ]
    assert len({layout.digest, *(c.digest for c in changed)}) == 6
    assert 0 <= layout.digest < 2**31
    assert StreamLayout.has_lead_room((a,)) and not StreamLayout.has_lead_room(())
    assert not StreamLayout.has_lead_room((TensorMeta("big", (4, 8), torch.bfloat16, 0, 64),))
