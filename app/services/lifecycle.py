"""The engine's side of every refit, shared by the single-process and the distributed service.

Three steps drive a RolloutEngine through a RefitRun: `begin_engine` (its storage fingerprint, then
its begin), `commit_engine` (finalize, record the commit at once, then the captured-storage
check: the only place that check runs) and `settle_engine` after a failure anywhere (abort a refit
the engine had not committed; restore or mark stale one it had). The engine's resulting state is
what the engine did, never where the lifecycle stood.
"""

from __future__ import annotations

from collections.abc import Callable

from domain.quant.plan import QuantizationPlan
from domain.refit.run import RefitRun
from domain.refit.status import EngineState
from domain.refit.storage import StorageFingerprint
from ports.rollout_engine import RolloutEngine

# Restores an engine that committed the failed refit (e.g. by replaying the previous refit's
# buckets): RESTORED, STALE, or None when it cannot (the engine is then marked stale).
Restore = Callable[[RolloutEngine, RefitRun, str], EngineState | None]


def describe_plan(plan: QuantizationPlan) -> str:
    """A plan in a few words: `linear=FP8_BLOCK moe=NVFP4`."""
    text = f"linear={plan.linear.name} moe={plan.moe.name}"
    if plan.moe_activation is not None:
        text += f" moe_activation={plan.moe_activation.value}"
    return text


def begin_engine(engine: RolloutEngine, run: RefitRun) -> StorageFingerprint:
    """Open the refit on the engine; returns its storage fingerprint from before the refit."""
    run.where = "begin"
    before = engine.storage_fingerprint()
    engine.begin_refit(run.refit_id)
    run.began = True
    return before


def commit_engine(engine: RolloutEngine, run: RefitRun, before: StorageFingerprint) -> None:
    """Finalize the engine's refit, record the commit, then check its captured storage.

    Raises:
        Exception: whatever the engine's finalize raised (it then kept its weights or went stale
            itself).
        RefitIncomplete: the engine left parameters unwritten (committed: settle it likewise).
        StorageRebound: a captured tensor was rebound (the engine had committed: the caller's
            settle_engine restores it or marks it stale).
    """
    with run.phase("finalize"):
        result = engine.finalize_refit()
    run.committed(result)
    run.check_written()
    with run.phase("verify", where="storage check"):
        run.check_storage(before, engine.storage_fingerprint())


def settle_engine(engine: RolloutEngine, run: RefitRun, reason: str, restore: Restore | None = None) -> EngineState:
    """After a failure: leave the engine with its previous weights, or stale, and say which.

    Args:
        engine: the engine of this side.
        run: the failed refit's run (its `engine` and `began` say what the engine did).
        reason: the failure, in words.
        restore: how to bring back the previous weights of an engine that committed this refit;
            None: such an engine is marked stale (it refuses to serve until a full refit).

    Returns:
        The engine's state, also stored in `run.engine`: KEPT (live weights untouched), RESTORED,
        or STALE.
    """
    if run.engine is EngineState.COMMITTED:
        state = restore(engine, run, reason) if restore is not None else None
        if state is None:
            engine.mark_stale(reason)
            state = EngineState.STALE
    else:
        if run.began:  # never abort a refit this service did not open
            engine.abort_refit(reason)  # a no-op when the engine already dropped it
        state = EngineState.STALE if engine.is_stale else EngineState.KEPT
    run.engine = state
    return state
