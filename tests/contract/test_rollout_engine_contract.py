"""Contract of the RolloutEngine port, run against the reference engine (both commit modes), the
recording engine, and the scripted faulty wrapper (with a fault that never fires)."""

from __future__ import annotations

import pytest
import torch

from adapters.memory import RecordingEngine, ScriptedFaultyEngine
from adapters.memory.faults import FaultPoint, FaultScript
from adapters.reference.config import MICRO_MOE
from adapters.reference.engine import ReferenceEngine
from domain.errors import (
    BucketSequenceError,
    EngineBusy,
    EngineStale,
    EngineTensorMismatch,
    RefitLifecycleError,
)
from domain.refit.session import CommitMode
from tests import refit_support as rs
from tests.refit_support import one_thread  # noqa: F401  (autouse fixture)

ENGINES = ("reference-transactional", "reference-per-layer", "recording", "faulty-wrapper", "vllm-fake", "sglang-fake")


@pytest.fixture(scope="module")
def refit_buckets():
    """Buckets of two successive refits (the trainer moves between them)."""
    t = rs.trainer()
    first = rs.buckets(rs.stream(t))
    t.perturb_(seed=1, scale=0.05)
    return first, rs.buckets(rs.stream(t))


def make_engine(kind: str):
    if kind.startswith("reference"):
        mode = CommitMode.PER_LAYER if kind.endswith("per-layer") else CommitMode.TRANSACTIONAL
        return ReferenceEngine(MICRO_MOE, rs.DEFAULT_PLAN, commit_mode=mode)
    if kind in ("vllm-fake", "sglang-fake"):  # the engine adapters over CPU fakes of vLLM / SGLang
        from tests.engine_fakes import stream_engine

        return stream_engine(kind.removesuffix("-fake"), MICRO_MOE.vocab_size)
    recording = RecordingEngine.for_stream(rs.stream(rs.trainer()), vocab_size=MICRO_MOE.vocab_size)
    if kind == "recording":
        return recording
    return ScriptedFaultyEngine(recording, FaultScript(FaultPoint.FINALIZE, after=10**6))


@pytest.fixture(params=ENGINES)
def engine(request):
    return make_engine(request.param)


def _serves(engine) -> bool:
    try:
        engine.log_probs(rs.token_ids())
    except (EngineStale, EngineBusy):
        return False
    return True


def test_a_fresh_engine_is_stale_until_its_first_full_refit(engine, refit_buckets):
    assert engine.is_stale and not _serves(engine)
    with pytest.raises(EngineStale):
        engine.log_probs(rs.token_ids())
    rs.full_refit(engine, refit_buckets[0])
    assert not engine.is_stale
    logp, entropy = engine.log_probs(rs.token_ids(batch=3, seq=10))
    assert logp.shape == entropy.shape == (3, 9)
    assert logp.dtype == torch.float32 and bool(torch.isfinite(logp).all()) and bool((logp <= 0).all())
    assert bool((entropy >= 0).all())


def test_refits_copy_in_place_and_never_rebind_storage(engine, refit_buckets):
    before = engine.storage_fingerprint()
    assert before.records  # the engine reports its captured tensors
    for i, bl in enumerate(refit_buckets * 2):
        result = rs.full_refit(engine, bl, refit_id=i + 1)
        assert result.tensors_committed > 0
        assert before.differences(engine.storage_fingerprint()) == []
    assert set(engine.live_weights()) == set(before.records)


def test_live_weights_change_with_the_refit(engine, refit_buckets):
    rs.full_refit(engine, refit_buckets[0])
    first = rs.bits(engine.live_weights())
    rs.full_refit(engine, refit_buckets[1], refit_id=2)
    assert not rs.same_bits(first, rs.bits(engine.live_weights()))
    rs.full_refit(engine, refit_buckets[0], refit_id=3)
    assert rs.same_bits(first, rs.bits(engine.live_weights()))


def test_out_of_order_duplicate_and_late_buckets_are_rejected(engine, refit_buckets):
    bl = refit_buckets[0]
    assert len(bl) >= 3
    engine.begin_refit(1)
    with pytest.raises(BucketSequenceError, match="out of order"):
        engine.load_bucket(bl[1])
    engine.load_bucket(bl[0])
    with pytest.raises(BucketSequenceError, match="duplicate"):
        engine.load_bucket(bl[0])
    with pytest.raises(BucketSequenceError, match="out of order"):
        engine.load_bucket(bl[2])  # bucket 1 is missing
    for b in bl[1:]:
        engine.load_bucket(b)
    with pytest.raises(BucketSequenceError, match="after the last"):
        engine.load_bucket(bl[-1])
    engine.finalize_refit()
    assert not engine.is_stale


def test_finalize_needs_the_last_bucket_and_runs_once(engine, refit_buckets):
    bl = refit_buckets[0]
    engine.begin_refit(1)
    engine.load_bucket(bl[0])
    with pytest.raises(BucketSequenceError, match="before the last bucket"):
        engine.finalize_refit()
    for b in bl[1:]:
        engine.load_bucket(b)
    engine.finalize_refit()
    with pytest.raises(RefitLifecycleError, match="cannot finalize"):
        engine.finalize_refit()


def test_begin_during_a_refit_is_rejected_and_no_serving_while_staging(engine, refit_buckets):
    rs.full_refit(engine, refit_buckets[0])
    engine.begin_refit(2)
    with pytest.raises(RefitLifecycleError, match="cannot begin"):
        engine.begin_refit(3)
    engine.load_bucket(refit_buckets[1][0])
    with pytest.raises(EngineBusy, match=r"does not serve|not serving"):
        engine.log_probs(rs.token_ids())
    engine.abort_refit("test")


def test_abort_keeps_weights_or_marks_stale_and_a_full_refit_recovers(engine, refit_buckets):
    rs.full_refit(engine, refit_buckets[0])
    before = rs.bits(engine.live_weights())
    logp_before, _ = engine.log_probs(rs.token_ids())
    engine.begin_refit(2)
    for b in refit_buckets[1][:-1]:
        engine.load_bucket(b)
    engine.abort_refit("trainer crashed")
    if engine.commit_mode is CommitMode.TRANSACTIONAL:
        assert rs.same_bits(before, rs.bits(engine.live_weights()))
        assert torch.equal(engine.log_probs(rs.token_ids())[0], logp_before)
    else:
        assert engine.is_stale and not _serves(engine)
    with pytest.raises(RefitLifecycleError):
        engine.finalize_refit()  # the aborted refit is over
    rs.full_refit(engine, refit_buckets[1], refit_id=3)
    assert not engine.is_stale and _serves(engine)


def test_abort_without_a_refit_is_a_no_op(engine, refit_buckets):
    engine.abort_refit("nothing to abort")
    rs.full_refit(engine, refit_buckets[0])
    before = rs.bits(engine.live_weights())
    engine.abort_refit("nothing to abort")
    assert _serves(engine) and rs.same_bits(before, rs.bits(engine.live_weights()))


def test_bad_tensors_are_rejected_and_drop_the_refit(engine, refit_buckets):
    rs.full_refit(engine, refit_buckets[0])
    before = rs.bits(engine.live_weights())
    name, t = rs.stream(rs.trainer())[0]
    for bad in ([("model.no_such_tensor", t)], [(name, t.float())], [(name, t[:-1])]):
        engine.begin_refit(5)
        with pytest.raises(EngineTensorMismatch):
            engine.load_bucket(rs.buckets(bad)[0])
        with pytest.raises(RefitLifecycleError):
            engine.finalize_refit()
        assert rs.same_bits(before, rs.bits(engine.live_weights()))


def test_reusing_the_sender_buffer_is_safe(engine, refit_buckets):
    named = rs.stream(rs.trainer())
    rs.full_refit(engine, rs.buckets(named))
    fresh = rs.bits(engine.live_weights())
    engine.begin_refit(2)
    shared_ptrs = set()
    for b in rs.buckets(named, reuse_buffer=False):  # materialized first: distinct buffers
        engine.load_bucket(b)
    engine.finalize_refit()
    engine.begin_refit(3)
    from domain.refit.buckets import pack_buckets

    for b in pack_buckets(named, rs.SMALL_BUCKET, reuse_buffer=True):  # one buffer, overwritten
        shared_ptrs.add(b.buffer.data_ptr() if len(b.metas) > 1 else None)
        engine.load_bucket(b)
    engine.finalize_refit()
    assert len(shared_ptrs - {None}) == 1
    assert rs.same_bits(fresh, rs.bits(engine.live_weights()))


def test_mark_stale_refuses_serving_until_a_full_refit(engine, refit_buckets):
    rs.full_refit(engine, refit_buckets[0])
    engine.mark_stale("storage check failed")
    assert engine.is_stale
    with pytest.raises(EngineStale, match="storage check failed"):
        engine.log_probs(rs.token_ids())
    rs.full_refit(engine, refit_buckets[0], refit_id=2)
    assert _serves(engine)
