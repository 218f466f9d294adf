"""The distributed refit service with in-memory collectives: every rank a thread of this process.

The same service as over torch.distributed, without spawning processes, so the fault matrix can
be run densely: on every engine rank, in both commit modes, `verify` and `hang:verify` (the
engine's verification before it commits) and `storage` / `hang:storage` (the storage check after
it committed). After the failed refit every engine's state (kept, restored or stale) is what its
weights show: a kept or restored engine holds the previous refit's weights bit for bit, a stale
one refuses to serve; replicas never diverge silently. A refit after that is bit-identical to the
single-process refit.

Bounds: every wait of a refit meant to succeed has a generous one (60 s). Only a refit with an
injected hang runs under the short phase bound, set once every rank has finished the refit
before it, and the hang lasts ten times that bound, so that no load reorders the two.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from adapters.memory.collectives import InMemoryWorld
from adapters.memory.faults import RankFault
from domain.errors import CollectiveTimeout, DistributedRefitFailed, EngineStale, PeerLost
from domain.refit.topology import ParallelLayout, RefitWorld
from tests.distributed import support

PRESETS = ("FP8_BLOCK", "NVFP4")
HANG_S = 3.0  # an injected hang: ten times the phase bound below
STEP_S, PHASE_S = 60.0, 0.3


def _rank(rank: int, world: RefitWorld, shared: InMemoryWorld, commit_mode: str, fault: RankFault | None,
          steps: int, first_done: threading.Barrier) -> dict[str, Any]:
    p = support.plan(*PRESETS)
    full = support.trainer_at(0) if world.role(rank) == "trainer" else None
    engine = support._engine(p, commit_mode) if full is None else None
    svc = support._service(world, rank, shared.collectives(rank), p, full, engine, fault)
    out: dict[str, Any] = {"outcomes": [], "errors": [], "digests": [], "stale": [], "serves": [], "engine": []}
    for step in range(steps):
        if step and full is not None:
            support.advance(full, step)
        if step == 1:
            first_done.wait(120)  # every rank is past refit 0: the refits' own bounds from here
        if svc.broken is not None:
            break
        try:
            out["outcomes"].append(svc.refit().outcome.value)
            out["errors"].append(None)
        except DistributedRefitFailed as err:
            out["outcomes"].append(err.report.outcome.value)
            out["errors"].append(str(err))
            out["engine"].append({s.rank: s.engine.value for s in err.statuses})
        except (CollectiveTimeout, PeerLost) as err:
            out["outcomes"].append(err.report.outcome.value if err.report else None)
            out["errors"].append(f"{type(err).__name__}: {err}")
        if engine is not None:
            out["digests"].append(support.digest(dict(engine.live_weights())))
            out["stale"].append(engine.is_stale)
            out["serves"].append(_serves(engine))
    return out


def _serves(engine: Any) -> bool:
    try:
        engine.log_probs(torch.zeros(1, 4, dtype=torch.int64))
    except EngineStale:
        return False
    return True


def run_world(world: RefitWorld, commit_mode: str = "transactional", fault: RankFault | None = None,
              steps: int = 3, phase_s: float = 60.0) -> list[dict[str, Any]]:
    """`steps` refits on every rank; refit 0 under generous bounds, the later ones under `phase_s`."""
    shared = InMemoryWorld(world, step_timeout_s=STEP_S, phase_timeout_s=60.0)
    first_done = threading.Barrier(world.size, action=lambda: setattr(shared, "phase_timeout_s", phase_s))
    results: dict[int, Any] = {}

    def run(rank: int) -> None:
        try:
            results[rank] = _rank(rank, world, shared, commit_mode, fault, steps, first_done)
        except BaseException as err:
            results[rank] = err

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    errors = {r: v for r, v in results.items() if isinstance(v, BaseException)}
    assert not errors and len(results) == world.size, errors
    return [results[r] for r in range(world.size)]


@pytest.fixture(scope="module")
def references() -> dict[int, dict[str, str]]:
    p = support.plan(*PRESETS)
    return {step: support.single_process_digest(p, step) for step in (0, 1, 2)}


@pytest.fixture(autouse=True)
def _short_hangs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(support, "HANG_S", HANG_S)


@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}, {"ep": 2}])
def test_every_layout_is_bit_identical_to_the_single_process_refit(layout, references) -> None:
    results = run_world(RefitWorld(ParallelLayout(**layout), 2))
    for rec in results:
        assert rec["outcomes"] == ["live"] * 3, rec["errors"]
    for engine in (2, 3):
        assert results[engine]["digests"] == [references[s] for s in range(3)]


def _engine_states(results: list[dict[str, Any]]) -> dict[int, str]:
    """What every rank says each engine did in the failed refit (the same on every rank)."""
    reports = [r["engine"][0] for r in results if r["engine"]]
    assert reports and all(rep == reports[0] for rep in reports), reports
    return {rank: state for rank, state in reports[0].items() if rank >= 2}


@pytest.mark.parametrize("commit_mode", ["transactional", "per-layer"])
@pytest.mark.parametrize("point", ["verify", "storage"])
@pytest.mark.parametrize("engine_rank", [2, 3])
def test_engine_faults_report_what_every_engine_did(commit_mode, point, engine_rank, references) -> None:
    """Refit 0 succeeds, refit 1 fails on one engine at `point`, refit 2 succeeds again."""
    fault = RankFault(engine_rank, point, refit=1)
    results = run_world(RefitWorld(ParallelLayout(tp=2), 2), commit_mode, fault)
    assert all(r["outcomes"][0] == r["outcomes"][2] == "live" for r in results)
    assert len({r["errors"][1] for r in results}) == 1  # every rank raises the same failure
    states = _engine_states(results)
    for rank in (2, 3):
        rec = results[rank]
        said, stale = states[rank], rec["stale"][1]
        assert stale == (said == "stale") and rec["serves"][1] is not stale, (rank, said)
        if said in ("kept", "restored"):
            assert rec["digests"][1] == references[0], f"engine {rank} says {said} but holds other weights"
        assert rec["digests"][2] == references[2] and not rec["stale"][2]
    if commit_mode == "transactional":
        # The faulty engine kept (verify: before its commit) or was restored (storage: after it);
        # the other engine had committed and replayed the previous refit.
        assert states[engine_rank] == ("kept" if point == "verify" else "restored")
        assert states[5 - engine_rank] == "restored"
    else:
        # Per-layer engines keep no copy: one that wrote layers is stale. The faulty engine's
        # verification fails at its first layer (nothing written: kept); a storage fault comes
        # after it wrote everything (stale).
        assert states[engine_rank] == ("kept" if point == "verify" else "stale")
        assert states[5 - engine_rank] == "stale"
    assert {r["outcomes"][1] for r in results} == ({"rolled-back"} if commit_mode == "transactional" else {"stale"})


@pytest.mark.parametrize("commit_mode", ["transactional", "per-layer"])
@pytest.mark.parametrize("point", ["verify", "storage"])
@pytest.mark.parametrize("engine_rank", [2, 3])
def test_a_hanging_engine_leaves_every_engine_truthfully_kept_restored_or_stale(commit_mode, point, engine_rank,
                                                                                references) -> None:
    """hang:verify / hang:storage on one engine: its peers time out at the `finalized` agreement.
    Each engine settles on its own; what it then holds matches what it reports of itself."""
    fault = RankFault(engine_rank, point, hang=True, refit=1)
    results = run_world(RefitWorld(ParallelLayout(tp=2), 2), commit_mode, fault, steps=2, phase_s=PHASE_S)
    for rank in (2, 3):
        rec = results[rank]
        assert rec["outcomes"][0] == "live" and rec["errors"][1] is not None
        assert rec["serves"][1] is not rec["stale"][1]  # a stale engine refuses to serve
        if not rec["stale"][1]:
            assert rec["digests"][1] == references[0], f"engine {rank}: serves weights of no refit"
        if rec["engine"]:  # the peers agreed on the ending: each engine's state as every rank reports it
            for e in (2, 3):
                said = rec["engine"][0][e]
                assert results[e]["stale"][1] == (said == "stale"), f"rank {rank} says engine {e} {said}"
            # the refit's outcome is the world's: stale when any engine is (RefitRun.outcome)
            any_stale = any(results[e]["stale"][1] for e in (2, 3))
            assert rec["outcomes"][1] == ("stale" if any_stale else "rolled-back"), (rank, rec["outcomes"][1])
        else:  # a timed-out agreement: the rank knows its own engine only
            assert rec["outcomes"][1] == ("stale" if rec["stale"][1] else "rolled-back"), (rank, rec["outcomes"][1])
    if commit_mode == "transactional":
        assert not any(results[r]["stale"][1] for r in (2, 3))  # kept or restored, never half-updated
