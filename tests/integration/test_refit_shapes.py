"""One refit transaction, every deployment shape: the same faults give the same outcomes, the
same engine states and the same report fields, whether the refit runs in one process (buckets by
reference, or packed into a reused buffer as for an engine in processes of its own) or across the
ranks of a world (a trainer rank and an engine rank, each a thread, in-memory collectives).

For every fault point (the engine's begin, a bucket, finalize, the engine's verification before
it commits, the storage check after it committed, and the post-refit probe) and every restore
strategy, the second refit fails there, then a third one recovers. The real-engine half of the
suite (a vLLM engine colocated and in processes of its own) is tests/vllm/test_refit_shapes.py; it
takes its table from here.
"""

from __future__ import annotations

import threading
from typing import Any

import attrs
import pytest
import torch

from adapters.memory import ScriptedFaultyEngine
from adapters.memory.collectives import InMemoryWorld
from adapters.memory.faults import FaultScript
from adapters.reference.config import MICRO_MOE, hf_weight_shapes
from adapters.reference.engine import ReferenceEngine
from adapters.reference.trainer import ReferenceTrainer
from app.services.distributed_refit import DistributedRefitService
from app.services.refit import RefitService
from app.services.transaction import Ownership, Restore
from app.services.verification import PostRefitProbe, TrainerReference, probe_batch
from domain.errors import ConfigError, EngineStale, RefitFailed
from domain.refit.report import RefitOutcome, RefitReport
from domain.refit.session import CommitMode
from domain.refit.status import EngineState
from domain.refit.topology import ParallelLayout, RefitWorld
from tests import refit_support as rs
from tests.refit_support import one_thread  # noqa: F401  (autouse fixture)

POINTS = ("begin", "bucket:1", "finalize", "verify", "storage", "probe")
SHAPES = ("single", "single-reused", "distributed")
RESTORES = (Restore.REPLAY, Restore.STALE, Restore.ENGINE)
ENGINES = 1  # engine ranks of the distributed shape (tests/integration/test_distributed_in_memory.py: more)


def expected(point: str, mode: CommitMode, restore: Restore) -> tuple[RefitOutcome, EngineState]:
    """What a refit failing at `point` leaves: the same in every shape.

    Before the engine commits, a transactional engine aborts and keeps its weights; a per-layer
    engine has written layers by then (except at begin, and at its verification, which checks
    every group before the first is written). After the commit (the storage check, the probe)
    every engine has lost its previous weights. An engine that lost them is restored by a replay
    of the previous refit's buckets, or goes stale.
    """
    committed = point in ("storage", "probe")
    lost = committed or (mode is CommitMode.PER_LAYER and point in ("bucket:1", "finalize"))
    if not lost:
        return RefitOutcome.ROLLED_BACK, EngineState.KEPT
    if restore is Restore.REPLAY:
        return RefitOutcome.ROLLED_BACK, EngineState.RESTORED
    return RefitOutcome.STALE, EngineState.STALE


@attrs.define
class FlakyReference:
    """The trainer's log-probs, off by 1.0 at the `fail_at`-th measurement (from 0): the probe of
    that refit must fail."""

    inner: TrainerReference
    fail_at: int
    calls: int = 0
    name: str = "the trainer's BF16 forward"
    engine_way: bool = False

    def log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.inner.log_probs(input_ids)
        self.calls += 1
        return out + 1.0 if self.calls - 1 == self.fail_at else out


def _probe(trainer: ReferenceTrainer, point: str) -> PostRefitProbe:
    reference = FlakyReference(TrainerReference(trainer), fail_at=1 if point == "probe" else -1)
    return PostRefitProbe(reference, probe_batch(MICRO_MOE.vocab_size))  # type: ignore[arg-type]


def _engine(mode: CommitMode, point: str) -> tuple[ReferenceEngine, Any]:
    inner = ReferenceEngine(MICRO_MOE, rs.DEFAULT_PLAN, commit_mode=mode)
    if point == "probe":
        return inner, inner
    return inner, ScriptedFaultyEngine(inner, attrs.evolve(FaultScript.parse(point), after=1))


@attrs.frozen
class Observed:
    """What one shape did with one fault: the failed refit's outcome and what each engine shows."""

    outcome: RefitOutcome
    states: tuple[EngineState, ...]
    serves_previous: tuple[bool, ...]  # serves exactly the first refit's weights
    refuses: tuple[bool, ...]  # refuses to serve (stale)
    fields: tuple[str, ...]  # report fields that are set
    ok_fields: tuple[str, ...]  # ... of the refits that went live
    recovered: bool  # the next refit is live and bit-identical to a fresh refit


def _set_fields(report: RefitReport) -> tuple[str, ...]:
    values = attrs.asdict(report, recurse=False)
    return tuple(sorted(k for k, v in values.items() if k != "timings" and v not in (None, (), 0, "")))


def _refuses(engine: ReferenceEngine) -> bool:
    try:
        engine.log_probs(rs.token_ids())
    except EngineStale:
        return True
    return False


def _fresh_bits(trainer: ReferenceTrainer) -> dict[str, torch.Tensor]:
    fresh = ReferenceEngine(MICRO_MOE, rs.DEFAULT_PLAN)
    rs.full_refit(fresh, rs.buckets(rs.stream(trainer)))
    return rs.bits(fresh.live_weights())


def _single(mode: CommitMode, point: str, restore: Restore, ownership: Ownership) -> Observed:
    trainer = rs.trainer()
    inner, engine = _engine(mode, point)
    svc = RefitService(trainer, engine, rs.DEFAULT_PLAN, bucket_bytes=rs.SMALL_BUCKET, ownership=ownership,
                       restore=restore, probe=_probe(trainer, point))
    ok = svc.refit()
    previous = rs.bits(inner.live_weights())
    trainer.perturb_(seed=7, scale=0.05)
    with pytest.raises(RefitFailed) as info:
        svc.refit()
    report = info.value.report
    states = (EngineState(report.engine_state),)
    serves_previous = (rs.same_bits(previous, rs.bits(inner.live_weights())) and not inner.is_stale,)
    refuses = (_refuses(inner),)
    again = svc.refit()
    recovered = again.ok and rs.same_bits(_fresh_bits(trainer), rs.bits(inner.live_weights()))
    return Observed(report.outcome, states, serves_previous, refuses, _set_fields(report),
                    _set_fields(ok), recovered)


def _distributed(mode: CommitMode, point: str, restore: Restore) -> Observed:
    world = RefitWorld(ParallelLayout(1, 1, 1, 1), ENGINES)
    shared = InMemoryWorld(world, step_timeout_s=60.0, phase_timeout_s=60.0)
    shapes = hf_weight_shapes(MICRO_MOE)
    trainer = rs.trainer()
    results: dict[int, Any] = {}
    gate = threading.Barrier(world.size)

    def rank_main(rank: int) -> None:
        from adapters.distributed.sliced_trainer import SlicedTrainer

        try:
            if world.role(rank) == "trainer":
                inner = engine = None
                shards: Any = SlicedTrainer(trainer, world.layout, rank)
            else:
                shards = None
                inner, engine = _engine(mode, point) if rank == 1 else (None, None)
                if engine is None:
                    inner = engine = ReferenceEngine(MICRO_MOE, rs.DEFAULT_PLAN, commit_mode=mode)
            probe = _probe(trainer, point) if engine is not None and (rank == 1 or point != "probe") else None
            svc = DistributedRefitService(world, shared.collectives(rank), rs.DEFAULT_PLAN, shapes, trainer=shards,
                                          engine=engine, bucket_bytes=rs.SMALL_BUCKET, restore=restore, probe=probe)
            out: dict[str, Any] = {"ok": svc.refit()}
            out["previous"] = rs.bits(inner.live_weights()) if inner is not None else None
            gate.wait()
            if rank == 0:
                trainer.perturb_(seed=7, scale=0.05)
            gate.wait()
            try:
                svc.refit()
                out["failed"] = None
            except RefitFailed as err:
                out["failed"] = err.report
                out["states"] = [s.engine for s in err.statuses if s.role == "engine"]  # type: ignore[attr-defined]
            if inner is not None:
                out["serves_previous"] = rs.same_bits(out["previous"], rs.bits(inner.live_weights())) and \
                    not inner.is_stale
                out["refuses"] = _refuses(inner)
            out["again"] = svc.refit()
            out["inner"] = inner
            results[rank] = out
        except BaseException as err:  # reported by the main thread
            results[rank] = err

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for rank in range(world.size):
        if isinstance(results.get(rank), BaseException):
            raise results[rank]
    engines = [results[r] for r in range(world.size) if world.role(r) == "engine"]
    hit = results[1]
    assert hit["failed"] is not None, "the injected fault did not fail the refit"
    report: RefitReport = hit["failed"]
    fresh = _fresh_bits(trainer)
    recovered = all(e["again"].ok and rs.same_bits(fresh, rs.bits(e["inner"].live_weights())) for e in engines)
    return Observed(report.outcome, tuple(hit["states"]), tuple(e["serves_previous"] for e in engines),
                    tuple(e["refuses"] for e in engines), _set_fields(report), _set_fields(hit["ok"]), recovered)


def observe(shape: str, mode: CommitMode, point: str, restore: Restore) -> Observed:
    if shape == "distributed":
        return _distributed(mode, point, restore)
    return _single(mode, point, restore, Ownership.REUSED if shape == "single-reused" else Ownership.BY_REFERENCE)


def _cases() -> list[Any]:
    out = []
    for mode in CommitMode:
        for restore in RESTORES:
            if restore is Restore.ENGINE and mode is CommitMode.PER_LAYER:
                continue  # refused: a per-layer engine keeps no backup (test below)
            for point in POINTS:
                out.append(pytest.param(mode, restore, point, id=f"{mode.value}-{restore.value}-{point}"))
    return out


_OBSERVED: dict[tuple[Any, ...], Observed] = {}


def _observed(shape: str, mode: CommitMode, point: str, restore: Restore) -> Observed:
    key = (shape, mode, point, restore)
    if key not in _OBSERVED:
        _OBSERVED[key] = observe(shape, mode, point, restore)
    return _OBSERVED[key]


@pytest.mark.parametrize(("mode", "restore", "point"), _cases())
def test_every_shape_fails_alike(mode: CommitMode, restore: Restore, point: str) -> None:
    seen = {shape: _observed(shape, mode, point, restore) for shape in SHAPES}
    outcome, state = expected(point, mode, restore)
    for shape, got in seen.items():
        engines = len(got.states)
        assert got.outcome is outcome, (shape, got)
        assert got.states == (state,) * engines, (shape, got)
        assert got.serves_previous == (state is not EngineState.STALE,) * engines, (shape, got)
        assert got.refuses == (state is EngineState.STALE,) * engines, (shape, got)
        assert got.recovered, (shape, got)
    # The same report fields are set in every shape. The fields that differ by side, not by shape:
    # `source_bytes` (what a side exported) and `codec_path` (the path its codecs quantized with),
    # which a distributed engine rank never has: it quantizes nothing.
    side = {"source_bytes", "codec_path"}
    failed = {shape: frozenset(set(got.fields) - side) for shape, got in seen.items()}
    live = {shape: frozenset(set(got.ok_fields) - side) for shape, got in seen.items()}
    assert len(set(failed.values())) == 1, failed
    assert len(set(live.values())) == 1, live
    assert all("probe" in got.ok_fields for got in seen.values())  # the probe ran in every shape


def test_the_engines_own_backup_is_refused_for_a_per_layer_engine() -> None:
    engine = ReferenceEngine(MICRO_MOE, rs.DEFAULT_PLAN, commit_mode=CommitMode.PER_LAYER)
    with pytest.raises(ConfigError, match="restore"):
        RefitService(rs.trainer(), engine, rs.DEFAULT_PLAN, restore=Restore.ENGINE)


@pytest.mark.parametrize(("mode", "ownership", "want"), [
    (CommitMode.TRANSACTIONAL, Ownership.BY_REFERENCE, Restore.ENGINE),
    (CommitMode.TRANSACTIONAL, Ownership.REUSED, Restore.ENGINE),
    (CommitMode.TRANSACTIONAL, Ownership.OWNED, Restore.REPLAY),
    (CommitMode.PER_LAYER, Ownership.OWNED, Restore.STALE),
    (CommitMode.PER_LAYER, Ownership.BY_REFERENCE, Restore.STALE),
])
def test_the_default_restore_costs_no_copy(mode: CommitMode, ownership: Ownership, want: Restore) -> None:
    assert Restore.default(mode, ownership) is want



def test_the_composition_root_wires_the_probe_into_distributed_refits() -> None:
    """rollout.verify.enabled probes every engine rank's refit, as it probes a single-process one;
    an engine rank without the trainer's weights to compare with is refused, naming the key."""
    from app.bootstrap import bootstrap

    services = bootstrap(overrides=["reference.model=micro-moe", "rollout.verify.enabled=true",
                                    "rollout.checkpoint_engine.update_weights_bucket_megabytes=0.0625"])
    world = RefitWorld(ParallelLayout(1, 1, 1, 1), 1)
    shared = InMemoryWorld(world, step_timeout_s=60.0, phase_timeout_s=60.0)
    trainer = services.trainer_model()
    with pytest.raises(ConfigError, match=r"rollout\.verify\.enabled"):
        services.world.distributed_refit(world, 1, comm=shared.collectives(1))
    ranks = [services.world.distributed_refit(world, r, comm=shared.collectives(r), reference=trainer if r else None)
             for r in range(world.size)]
    reports: dict[int, RefitReport] = {}
    threads = [threading.Thread(target=lambda r=r: reports.__setitem__(r, ranks[r].refit()), daemon=True)
               for r in range(world.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert reports[1].ok and reports[1].probe is not None and reports[1].probe.passed
    assert reports[0].probe is None  # trainer ranks have no engine to probe


@pytest.mark.parametrize(("value", "want"), [(None, Restore.ENGINE), ("replay", Restore.REPLAY), ("stale", Restore.STALE)])
def test_the_restore_comes_from_the_configuration(value: str | None, want: Restore) -> None:
    from app.bootstrap import bootstrap

    overrides = ["reference.model=micro-moe"] + ([f"rollout.checkpoint_engine.restore={value}"] if value else [])
    svc = bootstrap(overrides=overrides).refit_service()
    assert svc.restore_policy is want


def test_a_restore_the_engine_cannot_honour_is_refused_naming_the_key() -> None:
    from app.bootstrap import bootstrap

    with pytest.raises(ConfigError, match="restore"):
        bootstrap(overrides=["reference.model=micro-moe", "rollout.commit_mode=per-layer",
                             "rollout.checkpoint_engine.restore=engine"]).refit_service()
    with pytest.raises(ConfigError, match=r"rollout\.checkpoint_engine\.restore"):
        bootstrap(overrides=["rollout.checkpoint_engine.restore=undo"])
