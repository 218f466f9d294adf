"""Captured storage: 20 refits never move a live tensor; a rebinding engine is caught, fails closed."""

from __future__ import annotations

import pytest

from adapters.memory import RebindingEngine, RecordingEngine
from adapters.reference.config import MICRO_MOE
from adapters.reference.engine import ReferenceEngine
from app.services.refit import RefitService
from domain.errors import EngineStale, RefitFailed, StorageRebound
from domain.refit.report import RefitOutcome
from domain.refit.session import CommitMode
from domain.refit.storage import StorageFingerprint
from tests import refit_support as rs
from tests.refit_support import one_thread  # noqa: F401  (autouse fixture)


@pytest.mark.parametrize("mode", list(CommitMode))
def test_twenty_refits_keep_pointer_shape_stride_and_dtype(mode):
    engine = ReferenceEngine(MICRO_MOE, rs.DEFAULT_PLAN, commit_mode=mode)
    svc = RefitService(rs.trainer(), engine, rs.DEFAULT_PLAN, bucket_bytes=rs.SMALL_BUCKET)
    first = engine.storage_fingerprint()
    # An independent record of every live tensor's identity, taken with torch calls directly.
    identity = {
        n: (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for n, t in engine.live_weights().items()
    }
    previous = rs.bits(engine.live_weights())
    for step in range(20):
        svc.trainer.perturb_(seed=step, scale=0.02)
        report = svc.refit()
        assert report.ok and report.storage.ok and report.storage.changed == ()
        now = {n: (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for n, t in engine.live_weights().items()}
        assert now == identity
        assert first.differences(engine.storage_fingerprint()) == []
        current = rs.bits(engine.live_weights())
        assert not rs.same_bits(previous, current)  # the values did change, in place
        previous = current


def test_a_rebinding_engine_is_caught_and_marked_stale():
    named = rs.stream(rs.trainer())
    engine = RebindingEngine.for_stream(named, vocab_size=MICRO_MOE.vocab_size)
    svc = RefitService(rs.trainer(), engine, rs.DEFAULT_PLAN, bucket_bytes=rs.SMALL_BUCKET)
    with pytest.raises(RefitFailed) as info:
        svc.refit()
    report = info.value.report
    assert isinstance(info.value.__cause__, StorageRebound)
    assert report.outcome is RefitOutcome.STALE and report.storage.checked and not report.storage.ok
    assert set(report.storage.changed) == {n for n, _ in named}
    assert str(report.storage).startswith("REBOUND")
    with pytest.raises(EngineStale):
        engine.log_probs(rs.token_ids())
    assert engine.events[-1][0] == "stale"


def test_the_same_engine_copying_in_place_passes():
    named = rs.stream(rs.trainer())
    engine = RecordingEngine.for_stream(named, vocab_size=MICRO_MOE.vocab_size)
    svc = RefitService(rs.trainer(), engine, rs.DEFAULT_PLAN, bucket_bytes=rs.SMALL_BUCKET)
    assert svc.refit().storage.ok
    for name, t in named:  # and it holds exactly what was sent
        assert rs.same_bits({name: engine.live_weights()[name]}, {name: t})


def test_fingerprint_differences_name_each_kind_of_change():
    engine = RecordingEngine.for_stream(rs.stream(rs.trainer()))
    fp = engine.storage_fingerprint()
    records = dict(fp.records)
    name = next(iter(records))
    rec = records[name]
    for changed in (
        {**records, name: type(rec)(rec.data_ptr + 256, rec.shape, rec.stride, rec.dtype)},
        {**records, name: type(rec)(rec.data_ptr, (*rec.shape, 1), (*rec.stride, 1), rec.dtype)},
        {**records, name: type(rec)(rec.data_ptr, rec.shape, rec.stride, None)},
    ):
        assert fp.differences(StorageFingerprint(changed)) == [name]
