"""The refit session state machine: every legal move, and typed errors for every illegal one."""

from __future__ import annotations

import itertools

import pytest
import torch

from adapters.memory.faults import FaultPoint, FaultScript
from domain.errors import BucketSequenceError, RefitLifecycleError
from domain.refit.buckets import Bucket
from domain.refit.session import TRANSITIONS, CommitMode, RefitEvent, RefitSession, RefitState
from domain.refit.storage import StorageFingerprint


def _bucket(index: int, last: bool = False) -> Bucket:
    return Bucket(index, torch.empty(0, dtype=torch.uint8), (), last)


def _staged(n: int, *, last: bool) -> RefitSession:
    s = RefitSession()
    s.begin(1)
    for i in range(n):
        s.accept(_bucket(i, last=last and i == n - 1))
    return s


def test_happy_path_reaches_live_and_can_refit_again():
    s = _staged(3, last=True)
    s.finalize()
    assert s.state is RefitState.FINALIZING
    s.commit()
    assert s.state is RefitState.LIVE and not s.in_progress
    s.begin(2)
    assert s.state is RefitState.STAGING and s.next_bucket == 0 and not s.last_received


def test_a_single_empty_last_bucket_is_a_complete_refit():
    s = _staged(1, last=True)
    s.finalize()
    s.commit()
    assert s.state is RefitState.LIVE


@pytest.mark.parametrize("index", [0, 1, 3])
def test_out_of_order_and_duplicate_buckets_are_rejected(index):
    s = _staged(2, last=False)
    with pytest.raises(BucketSequenceError, match="expected bucket 2"):
        s.accept(_bucket(index))
    assert s.next_bucket == 2  # a rejected bucket changes nothing


def test_a_bucket_after_the_last_is_rejected():
    s = _staged(2, last=True)
    with pytest.raises(BucketSequenceError, match="after the last bucket"):
        s.accept(_bucket(2))


def test_finalize_without_the_last_bucket_is_rejected():
    s = _staged(2, last=False)
    with pytest.raises(BucketSequenceError, match="before the last bucket"):
        s.finalize()
    assert s.state is RefitState.STAGING


def test_a_second_finalize_is_rejected():
    s = _staged(1, last=True)
    s.finalize()
    with pytest.raises(RefitLifecycleError, match="cannot finalize while finalizing"):
        s.finalize()
    s.commit()
    with pytest.raises(RefitLifecycleError, match="cannot finalize while live"):
        s.finalize()


def test_begin_during_a_refit_is_rejected():
    s = _staged(1, last=False)
    with pytest.raises(RefitLifecycleError, match="cannot begin while staging"):
        s.begin(2)


def test_failure_then_a_new_refit():
    s = _staged(1, last=False)
    s.fail()
    assert s.state is RefitState.FAILED
    with pytest.raises(RefitLifecycleError):
        s.accept(_bucket(1))
    s.begin(2)
    assert s.state is RefitState.STAGING


def test_every_pair_outside_the_table_raises_and_leaves_the_state():
    """Exhaustive: each (state, event) either follows the table or raises a lifecycle error."""
    for state, event in itertools.product(RefitState, RefitEvent):
        s = RefitSession(state=state, refit_id=7, last_received=True)
        act = {
            RefitEvent.BEGIN: lambda s=s: s.begin(8),
            RefitEvent.BUCKET: lambda s=s: s.accept(_bucket(s.next_bucket)),
            RefitEvent.FINALIZE: s.finalize,
            RefitEvent.COMMIT: s.commit,
            RefitEvent.FAIL: s.fail,
        }[event]
        target = TRANSITIONS.get((state, event))
        if event is RefitEvent.BUCKET and state is RefitState.STAGING:
            continue  # covered above: a bucket after the last one is a sequence error
        if target is None:
            with pytest.raises(RefitLifecycleError):
                act()
            assert s.state is state
        else:
            act()
            assert s.state is target


def test_fault_script_parsing():
    assert FaultScript.parse("bucket:3") == FaultScript(FaultPoint.BUCKET, 3)
    assert FaultScript.parse(" Finalize ") == FaultScript(FaultPoint.FINALIZE)
    assert str(FaultScript.parse("verify")) == "verify"
    for bad in ("bucket", "bucket:-1", "bucket:x", "finalize:2", "explode"):
        with pytest.raises(ValueError, match="bucket:K"):
            FaultScript.parse(bad)


def test_commit_mode_parsing():
    assert CommitMode.parse("per_layer") is CommitMode.PER_LAYER
    assert CommitMode.parse("Transactional") is CommitMode.TRANSACTIONAL
    with pytest.raises(ValueError, match="per-layer"):
        CommitMode.parse("lazy")


def test_storage_fingerprint_sees_rebinding_and_reshaping():
    a, b = torch.zeros(4, 4), torch.zeros(8)
    before = StorageFingerprint.of({"a": a, "b": b})
    a.copy_(torch.ones(4, 4))  # in-place: same identity
    assert before.differences(StorageFingerprint.of({"a": a, "b": b})) == []
    rebound = torch.ones(4, 4)
    assert before.differences(StorageFingerprint.of({"a": rebound, "b": b})) == ["a"]
    assert before.differences(StorageFingerprint.of({"a": a, "b": b.view(2, 4)})) == ["b"]
    assert before.differences(StorageFingerprint.of({"a": a.t(), "b": b})) == ["a"]
    assert before.differences(StorageFingerprint.of({"a": a})) == ["b"]
