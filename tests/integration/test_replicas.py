"""Two engine replicas refitted by one refit (data-parallel rollout), all or nothing: every
replica equals a fresh engine refitted alone, bit for bit; a fault in any replica, at any point,
leaves no replica serving weights another lacks; the next refit brings every replica back."""

from __future__ import annotations

import attrs
import pytest

from adapters.memory import ScriptedFaultyEngine
from adapters.memory.faults import FaultScript
from adapters.reference.config import MICRO_MOE
from adapters.reference.engine import ReferenceEngine
from app.bootstrap import bootstrap
from app.services.refit import RefitService
from app.services.replicas import ReplicatedEngine
from domain.errors import ConfigError, EngineStale, InjectedFault, RefitFailed
from domain.refit.report import RefitOutcome
from domain.refit.session import CommitMode
from tests import refit_support as rs
from tests.refit_support import one_thread  # noqa: F401  (autouse fixture)

N_BUCKETS = len(rs.buckets(rs.stream(rs.trainer())))
FAULTS = ["begin", *(f"bucket:{k}" for k in range(N_BUCKETS)), "finalize", "verify"]


def _alone(svc: RefitService) -> dict[str, object]:
    fresh = ReferenceEngine(MICRO_MOE, rs.DEFAULT_PLAN)
    rs.full_refit(fresh, rs.buckets(rs.stream(svc.trainer)))
    return rs.bits(fresh.live_weights())


def _serving(engine: ReferenceEngine) -> object:
    try:
        return engine.log_probs(rs.token_ids())[0]
    except EngineStale:
        return None


def test_the_composition_root_builds_replicas_and_one_refit_updates_each() -> None:
    services = bootstrap(overrides=["rollout.replicas=2", "reference.model=micro-moe"])
    engine = services.rollout_engine()
    assert isinstance(engine, ReplicatedEngine) and len(engine.replicas) == 2
    assert engine.replicas[0] is not engine.replicas[1]
    svc = services.refit_service(engine=engine)
    assert svc.refit().ok and not engine.is_stale
    a, b = (rs.bits(r.live_weights()) for r in engine.replicas)
    assert rs.same_bits(a, b)
    alone = bootstrap(overrides=["reference.model=micro-moe"]).refit_service(trainer=svc.trainer)
    assert alone.refit().ok  # the same trainer into one engine of its own
    assert rs.same_bits(a, rs.bits(alone.engine.live_weights()))
    with pytest.raises(ConfigError, match="two replicas or more"):
        ReplicatedEngine([engine.replicas[0]])


@pytest.mark.parametrize("mode", [CommitMode.TRANSACTIONAL, CommitMode.PER_LAYER])
@pytest.mark.parametrize("failing", [0, 1])
@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_in_either_replica_leaves_none_serving_weights_the_other_lacks(fault: str, failing: int,
                                                                               mode: CommitMode) -> None:
    inners = [ReferenceEngine(MICRO_MOE, rs.DEFAULT_PLAN, commit_mode=mode) for _ in range(2)]
    faulty = ScriptedFaultyEngine(inners[failing], attrs.evolve(FaultScript.parse(fault), after=1))
    replicas = [faulty if i == failing else e for i, e in enumerate(inners)]
    svc = RefitService(rs.trainer(), ReplicatedEngine(replicas), rs.DEFAULT_PLAN, bucket_bytes=rs.SMALL_BUCKET)
    assert svc.refit().ok
    old = _alone(svc)
    svc.trainer.perturb_(seed=7, scale=0.05)
    new = _alone(svc)
    with pytest.raises(RefitFailed) as info:
        svc.refit()
    assert isinstance(info.value.__cause__, InjectedFault) and faulty.fired == 1
    report = info.value.report
    assert report.outcome in (RefitOutcome.STALE, RefitOutcome.ROLLED_BACK)
    for inner in inners:
        weights = rs.bits(inner.live_weights())
        serving = _serving(inner)
        if report.outcome is RefitOutcome.STALE:
            assert inner.is_stale and serving is None  # every replica refuses: none serves a mix
        else:
            assert not inner.is_stale and rs.same_bits(weights, old)  # every replica kept the old weights
        assert not (serving is not None and rs.same_bits(weights, new))
    assert svc.refit().ok  # the next refit brings both back
    for inner in inners:
        assert not inner.is_stale and rs.same_bits(rs.bits(inner.live_weights()), new)
