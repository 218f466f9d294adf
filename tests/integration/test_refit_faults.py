"""Faults at every bucket, at finalize and at verification, through RefitService into the
reference engine: transactional keeps live weights bit-identical; per-layer goes stale and
refuses to serve; either way the next full refit succeeds."""

from __future__ import annotations

import attrs
import pytest

from adapters.memory import ScriptedFaultyEngine
from adapters.memory.faults import FaultScript
from adapters.reference.config import MICRO_MOE
from adapters.reference.engine import ReferenceEngine
from app.services.refit import RefitService
from domain.errors import EngineStale, InjectedFault, RefitFailed
from domain.refit.report import RefitOutcome
from domain.refit.session import CommitMode
from tests import refit_support as rs
from tests.refit_support import one_thread  # noqa: F401  (autouse fixture)

N_BUCKETS = len(rs.buckets(rs.stream(rs.trainer())))
FAULTS = [f"bucket:{k}" for k in range(N_BUCKETS)] + ["finalize", "verify"]


def _fail_once(mode: CommitMode, fault: str):
    """A service whose second refit hits `fault`; returns (service, inner engine, report, bits before)."""
    inner = ReferenceEngine(MICRO_MOE, rs.DEFAULT_PLAN, commit_mode=mode)
    engine = ScriptedFaultyEngine(inner, attrs.evolve(FaultScript.parse(fault), after=1))
    svc = RefitService(rs.trainer(), engine, rs.DEFAULT_PLAN, bucket_bytes=rs.SMALL_BUCKET)
    assert svc.refit().ok  # the initial sync
    svc.trainer.perturb_(seed=7, scale=0.05)
    before = rs.bits(inner.live_weights())
    logp_before = inner.log_probs(rs.token_ids())[0]
    with pytest.raises(RefitFailed) as info:
        svc.refit()
    assert isinstance(info.value.__cause__, InjectedFault)
    assert engine.fired == 1
    return svc, inner, info.value.report, before, logp_before


def _recovers(svc: RefitService, inner: ReferenceEngine) -> None:
    report = svc.refit()
    assert report.ok and not inner.is_stale
    fresh = ReferenceEngine(MICRO_MOE, rs.DEFAULT_PLAN)
    rs.full_refit(fresh, rs.buckets(rs.stream(svc.trainer)))
    assert rs.same_bits(rs.bits(fresh.live_weights()), rs.bits(inner.live_weights()))


@pytest.mark.parametrize("fault", FAULTS)
def test_transactional_failure_leaves_live_weights_bit_identical(fault):
    svc, inner, report, before, logp_before = _fail_once(CommitMode.TRANSACTIONAL, fault)
    assert report.outcome is RefitOutcome.ROLLED_BACK and "bit for bit" in report.error
    assert rs.same_bits(before, rs.bits(inner.live_weights()))
    assert not inner.is_stale
    assert (inner.log_probs(rs.token_ids())[0] == logp_before).all()  # still serves the old weights
    _recovers(svc, inner)


@pytest.mark.parametrize("fault", FAULTS)
def test_per_layer_failure_goes_stale_or_leaves_weights_untouched(fault):
    svc, inner, report, before, _ = _fail_once(CommitMode.PER_LAYER, fault)
    if report.outcome is RefitOutcome.STALE:
        assert inner.is_stale and "refuses to serve" in report.error
        with pytest.raises(EngineStale):
            inner.log_probs(rs.token_ids())
    else:  # it failed before any layer was committed
        assert report.outcome is RefitOutcome.ROLLED_BACK
        assert rs.same_bits(before, rs.bits(inner.live_weights()))
    _recovers(svc, inner)


@pytest.mark.parametrize("fault", ["finalize", f"bucket:{N_BUCKETS - 1}"])
def test_per_layer_failure_after_commits_is_stale(fault):
    _, inner, report, before, _ = _fail_once(CommitMode.PER_LAYER, fault)
    assert report.outcome is RefitOutcome.STALE
    assert not rs.same_bits(before, rs.bits(inner.live_weights()))  # layers were half-updated...
    with pytest.raises(EngineStale, match="full refit"):
        inner.log_probs(rs.token_ids())  # ...so the engine refuses to serve them


def test_report_counts_what_was_sent_before_the_failure():
    _, _, report, _, _ = _fail_once(CommitMode.TRANSACTIONAL, "bucket:2")
    assert report.buckets == 2 and report.storage.checked is False
    assert "failed at bucket 2" in report.error
