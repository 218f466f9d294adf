"""The embedded engine after `close()`, and two threads refitting one engine at once.

Before: a refit after `close()` went live on the embedded engine, and when threads refitted at
once, the losers were told "the engine is stale" while the winner's refit went live (the loser's
clean-up marked the engine stale, and could abort the winner's refit). Now a closed engine answers
EngineClosed to everything, and a refit that could not begin because another thread's refit is in
progress says exactly that and touches nothing.
"""

from __future__ import annotations

import threading

import pytest
import torch

from app.bootstrap import bootstrap
from domain.errors import EngineClosed, RefitFailed, RefitInProgress, RefitLifecycleError
from domain.refit.guard import EngineGuard

OVERRIDES = ["reference.model=micro-dense"]


def test_a_refit_after_close_does_not_go_live() -> None:
    services = bootstrap(overrides=OVERRIDES)
    engine = services.rollout_engine()
    svc = services.refit_service(engine=engine)
    svc.refit()
    before = {k: t.clone() for k, t in engine.live_weights().items()}
    engine.close()
    with pytest.raises(RefitFailed) as info:  # before: outcome live
        svc.refit()
    assert isinstance(info.value.__cause__, EngineClosed)
    assert "EngineClosed" in str(info.value) and "changed nothing" in str(info.value)
    assert all(torch.equal(before[k], t) for k, t in engine.live_weights().items())
    with pytest.raises(EngineClosed):
        engine.log_probs(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(EngineClosed):
        engine.begin_refit(99)


def test_close_aborts_a_refit_in_progress() -> None:
    engine = bootstrap(overrides=OVERRIDES).rollout_engine()
    engine.begin_refit(1)
    engine.close()
    with pytest.raises(EngineClosed):
        engine.finalize_refit()


def test_threads_refitting_at_once_are_told_the_truth() -> None:
    services = bootstrap(overrides=OVERRIDES)
    engine = services.rollout_engine()
    trainer = services.trainer_model()
    # the first thread's refit, once begun, waits in its trainer until every other thread has tried
    entered, tried = threading.Event(), threading.Barrier(4)

    class Held:
        def __getattr__(self, name: str) -> object:
            return getattr(trainer, name)

        def named_weights(self):  # type: ignore[no-untyped-def]
            entered.set()
            tried.wait(timeout=60)
            return trainer.named_weights()

    outcomes: list[object] = []

    def refit(first: bool) -> None:
        if not first:
            assert entered.wait(timeout=60)
        try:
            source = Held() if first else trainer
            outcomes.append(services.refit_service(engine=engine, trainer=source).refit().outcome.value)  # type: ignore[arg-type]
        except RefitFailed as err:
            outcomes.append(err)
        finally:
            if not first:
                tried.wait(timeout=60)

    threads = [threading.Thread(target=refit, args=(i == 0,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert outcomes.count("live") == 1, outcomes
    losers = [o for o in outcomes if isinstance(o, RefitFailed)]
    assert len(losers) == 3
    for err in losers:  # before: "the engine is stale and refuses to serve until a full refit succeeds"
        assert isinstance(err.__cause__, RefitInProgress), err
        assert "another thread" in str(err) and "stale" not in str(err)
    assert not engine.is_stale  # the winner's refit is live, and no loser marked the engine stale
    engine.log_probs(torch.zeros(1, 4, dtype=torch.long))


def test_the_guard_tells_the_same_thread_to_finish_its_own_refit() -> None:
    guard = EngineGuard()
    guard.begin(1)
    with pytest.raises(RefitLifecycleError) as info:
        guard.begin(2)
    assert not isinstance(info.value, RefitInProgress)
