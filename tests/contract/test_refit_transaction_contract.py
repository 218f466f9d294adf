"""Contract of RefitTransaction (app.services.transaction), run against every engine that runs here
without vLLM: the reference engine (both commit modes), the in-memory recording engine, the vLLM
adapter over its CPU fakes (in process, colocated through the worker extension, and attached to a
fake server through the rl_refit backend), and the SGLang adapter over its fakes.

One transaction per refit, used as a service uses it (`with transaction(...) as tx:`): entering
begins, the block streams the buckets, leaving commits (finalize, audit, storage check, probe) and
goes live, or settles and raises RefitFailed with the report. A refit that succeeds leaves the
engine serving exactly the weights a fresh engine of the same kind gets from the same buckets. A
refit that fails at any step (the engine's begin, a bucket, finalize, the engine's verification,
the storage check after the commit, the probe) settles as the engine's commit mode and the restore
strategy say (the table of tests/integration/test_refit_shapes.py): the engine keeps or gets back
its previous weights bit for bit, or refuses to serve; and the next refit recovers. Every check is
on end states: the engine's weights, the report's outcome and engine state, whether it serves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import torch

from adapters.memory import RecordingEngine, ScriptedFaultyEngine
from adapters.memory.faults import FaultScript
from adapters.reference.config import MICRO_MOE
from adapters.reference.engine import ReferenceEngine
from app.services.refit import PHASES
from app.services.transaction import ReplayCopy, Restore, describe_plan, transaction
from domain.errors import CollectiveTimeout, EngineStale, ProbeMismatch, RefitFailed
from domain.quant.plan import QuantizationPlan
from domain.quant.stream import quantize_stream
from domain.refit.buckets import Bucket
from domain.refit.report import RefitOutcome, RefitReport
from domain.refit.run import RefitRun
from domain.refit.session import CommitMode
from domain.refit.status import EngineState, RankStatus, Role
from tests import refit_support as rs
from tests.integration.test_refit_shapes import POINTS, expected
from tests.refit_support import one_thread  # noqa: F401  (autouse fixture)

BUCKET = rs.SMALL_BUCKET  # every stream below takes several buckets
COMMITTED = ("storage", "probe")  # the steps after the engine committed
FAKE_VLLM_VOCAB = 64  # tests/engine_fakes/vllm.py's FakeVllmModel


# --- the engines -------------------------------------------------------------------------------


@attrs.define
class Subject:
    """One engine under the contract, and what the suite needs around it.

    Attributes:
        engine: the RolloutEngine the transactions drive (the faulty wrapper when a fault is scripted).
        weights: a bit-exact snapshot of the weights it serves.
        refits: refit k's buckets (k = 0, 1, 2: the trainer moves between them).
        plan: the rollout plan of the stream.
        keeps_weights_on_abort: an aborted refit leaves the previous weights (a transactional
            engine, or workers that restore their backup), whatever the commit mode says.
        undoes_commit: a committed refit the trainer refuses is undone from the engine's backup.
        vocab_size: the vocabulary its model serves.
        close: lets the engine go.
    """

    engine: Any
    weights: Callable[[], dict[str, torch.Tensor]]
    refits: Callable[[int], list[Bucket]]
    plan: QuantizationPlan
    keeps_weights_on_abort: bool
    undoes_commit: bool = False
    vocab_size: int = MICRO_MOE.vocab_size
    close: Callable[[], None] = lambda: None

    def refuses_to_serve(self) -> bool:
        """The engine refuses a request as stale (it would serve incomplete or unknown weights)."""
        tokens = torch.randint(0, self.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
        try:
            self.engine.log_probs(tokens)
        except EngineStale:
            return True
        return False


@functools.cache
def _micro_stream(k: int) -> tuple[tuple[str, torch.Tensor], ...]:
    """The micro model's checkpoint tensors at refit k."""
    trainer = rs.trainer()
    for step in range(k):
        trainer.perturb_(seed=7 + step, scale=0.05)
    return tuple(rs.stream(trainer))


@functools.cache
def _fake_vllm_stream(k: int) -> tuple[tuple[str, torch.Tensor], ...]:
    """The fake vLLM model's checkpoint tensors at refit k (FP8 block)."""
    from tests.engine_fakes.vllm import FakeTrainer, fp8_plan

    return tuple(quantize_stream(fp8_plan(), FakeTrainer(seed=k).named_weights()))


def _micro_refits(k: int) -> list[Bucket]:
    return rs.buckets(list(_micro_stream(k)), BUCKET)


def _fake_vllm_refits(k: int) -> list[Bucket]:
    return rs.buckets(list(_fake_vllm_stream(k)), BUCKET)


def _faulty(engine: Any, fault: FaultScript | None) -> Any:
    return engine if fault is None else ScriptedFaultyEngine(engine, fault)


def _reference(mode: CommitMode) -> Callable[[FaultScript | None], Subject]:
    def make(fault: FaultScript | None) -> Subject:
        inner = ReferenceEngine(MICRO_MOE, rs.DEFAULT_PLAN, commit_mode=mode)
        return Subject(_faulty(inner, fault), lambda: rs.bits(inner.live_weights()), _micro_refits, rs.DEFAULT_PLAN,
                       keeps_weights_on_abort=mode is CommitMode.TRANSACTIONAL)
    return make


def _recording(fault: FaultScript | None) -> Subject:
    inner = RecordingEngine.for_stream(_micro_stream(0), vocab_size=MICRO_MOE.vocab_size)
    return Subject(_faulty(inner, fault), lambda: rs.bits(inner.live_weights()), _micro_refits, rs.DEFAULT_PLAN,
                   keeps_weights_on_abort=True)


def _stream_engine(name: str) -> Callable[[FaultScript | None], Subject]:
    def make(fault: FaultScript | None) -> Subject:
        from tests.engine_fakes import stream_engine

        inner = stream_engine(name, MICRO_MOE.vocab_size)
        return Subject(_faulty(inner, fault), lambda: rs.bits(inner.live_weights()), _micro_refits, rs.DEFAULT_PLAN,
                       keeps_weights_on_abort=inner.commit_mode is CommitMode.TRANSACTIONAL)
    return make


def _model_bits(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return rs.bits(dict(model.named_parameters()))


def _vllm_colocated(fault: FaultScript | None) -> Subject:
    from tests.engine_fakes.vllm import extension_engine, fp8_plan

    models, _, inner = extension_engine(quantized=True)
    return Subject(_faulty(inner, fault), lambda: _model_bits(models[0]), _fake_vllm_refits, fp8_plan(),
                   keeps_weights_on_abort=False, vocab_size=FAKE_VLLM_VOCAB)


def _vllm_attached(fault: FaultScript | None) -> Subject:
    from adapters.vllm.attached import Expected, attach
    from tests.engine_fakes.vllm import FakeVllmModel, fp8_plan
    from tests.engine_fakes.vllm_server import FakeServer

    model = FakeVllmModel()
    inner = attach(FakeServer([model]), Expected(), bucket_bytes=1 << 20, settings={"timeout_s": 60.0})
    return Subject(_faulty(inner, fault), lambda: _model_bits(model), _fake_vllm_refits, fp8_plan(),
                   keeps_weights_on_abort=True, undoes_commit=True, vocab_size=FAKE_VLLM_VOCAB, close=inner.close)


KINDS: dict[str, Callable[[FaultScript | None], Subject]] = {
    "reference-transactional": _reference(CommitMode.TRANSACTIONAL),
    "reference-per-layer": _reference(CommitMode.PER_LAYER),
    "recording": _recording,
    "vllm-in-process": _stream_engine("vllm"),
    "vllm-colocated": _vllm_colocated,
    "vllm-attached": _vllm_attached,
    "sglang-in-process": _stream_engine("sglang"),
}


@pytest.fixture
def subjects() -> Any:
    """Makes subjects of a kind, and lets every one go after the test."""
    made: list[Subject] = []

    def make(kind: str, fault: FaultScript | None = None) -> Subject:
        made.append(KINDS[kind](fault))
        return made[-1]

    yield make
    for subject in made:
        subject.close()


# --- one refit, one transaction -------------------------------------------------------------


@attrs.frozen
class Refuses:
    """A post-refit probe that finds the engine too far from the trainer."""

    def measure(self, engine: Any, plan: QuantizationPlan) -> Any:
        raise ProbeMismatch(2, 9.0, 0.0, "the trainer")


def refit(subject: Subject, k: int, restore: Restore, replay: ReplayCopy | None = None,
          probe: Any = None) -> RefitReport:
    """Refit k into the subject's engine through one RefitTransaction, used as a service uses it;
    the report of a live refit, or the one a failed refit's error carries once the engine is settled."""
    engine = subject.engine
    run = RefitRun(k + 1, describe_plan(subject.plan), BUCKET, engine.commit_mode.value, PHASES)
    try:
        with transaction(engine, run, subject.plan, restore=restore, replay=replay, probe=probe) as tx:
            if tx.begun:
                for bucket in subject.refits(k):
                    tx.load(bucket)
    except RefitFailed as failed:
        return failed.report
    return tx.result


def _fresh(kind: str, k: int, subjects: Any) -> dict[str, torch.Tensor]:
    """What a fresh engine of `kind` serves after refit k's buckets, loaded through the port alone."""
    fresh = subjects(kind)
    rs.full_refit(fresh.engine, fresh.refits(k))
    return fresh.weights()


def _restores(kind: str) -> list[Restore]:
    """The restores a service accepts for the engine (its own backup: transactional engines only)."""
    per_layer = KINDS[kind](None)
    try:
        mode = per_layer.engine.commit_mode
    finally:
        per_layer.close()
    return [r for r in Restore if r is not Restore.ENGINE or mode is CommitMode.TRANSACTIONAL]


def _points(kind: str) -> list[str]:
    """The fault points an engine can be made to fail at (`verify` needs its verifiers list)."""
    verifies = kind in ("reference-transactional", "reference-per-layer", "recording")
    return [p for p in (*POINTS,) if p != "verify" or verifies]


def _cases() -> list[Any]:
    return [pytest.param(kind, restore, point, id=f"{kind}-{restore.value}-{point}")
            for kind in KINDS for restore in _restores(kind) for point in _points(kind)]


def settles_to(point: str, subject: Subject, restore: Restore) -> tuple[RefitOutcome, EngineState]:
    """What a refit failing at `point` leaves this engine with: the fault table of
    tests/integration/test_refit_shapes.py, for the engine's behaviour rather than its declared
    commit mode (workers that restore their backup keep the weights on abort, as a transactional
    engine does), and an engine that undoes a commit from its own backup is restored after it."""
    if point in COMMITTED and subject.undoes_commit:
        return RefitOutcome.ROLLED_BACK, EngineState.RESTORED
    mode = CommitMode.TRANSACTIONAL if subject.keeps_weights_on_abort else CommitMode.PER_LAYER
    return expected(point, mode, restore)


# --- the contract ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_refit_that_succeeds_leaves_the_engine_live_with_the_new_weights(kind: str, subjects: Any) -> None:
    subject = subjects(kind)
    assert refit(subject, 0, Restore.STALE).ok
    before = subject.weights()
    report = refit(subject, 1, Restore.STALE)
    assert report.outcome is RefitOutcome.LIVE and report.ok, report.error
    assert report.engine_state == EngineState.LIVE.value
    assert report.buckets == len(subject.refits(1)) and report.error is None
    after = subject.weights()
    assert rs.same_bits(after, _fresh(kind, 1, subjects))  # the new weights, bit for bit
    assert not rs.same_bits(after, before)
    assert not subject.engine.is_stale and not subject.refuses_to_serve()


@pytest.mark.parametrize(("kind", "restore", "point"), _cases())
def test_a_failure_settles_as_the_engines_commit_mode_and_the_restore_say(kind: str, restore: Restore, point: str,
                                                                        subjects: Any) -> None:
    fault = None if point == "probe" else attrs.evolve(FaultScript.parse(point), after=1)  # the second refit fails
    subject = subjects(kind, fault)
    replay = ReplayCopy.for_buckets(BUCKET) if restore is Restore.REPLAY else None
    assert refit(subject, 0, restore, replay).ok
    previous = subject.weights()

    report = refit(subject, 1, restore, replay, probe=Refuses() if point == "probe" else None)
    outcome, state = settles_to(point, subject, restore)
    assert (report.outcome, report.engine_state) == (outcome, state.value), report.error
    assert report.error  # the failure, in words
    if state is EngineState.STALE:
        assert subject.engine.is_stale and subject.refuses_to_serve()
    else:  # kept or restored: the previous refit's weights, bit for bit, served
        assert rs.same_bits(subject.weights(), previous)
        assert not subject.engine.is_stale and not subject.refuses_to_serve()

    again = refit(subject, 2, restore, replay)  # the next refit recovers
    assert again.ok, again.error
    assert rs.same_bits(subject.weights(), _fresh(kind, 2, subjects))
    assert not subject.refuses_to_serve()


class Interrupted(Exception):
    """What a block raises when the trainer side stops mid-stream."""


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_exception_raised_in_the_block_settles_the_refit_and_raises_refit_failed(kind: str, subjects: Any) -> None:
    subject = subjects(kind)
    assert refit(subject, 0, Restore.STALE).ok
    previous = subject.weights()
    run = RefitRun(2, describe_plan(subject.plan), BUCKET, subject.engine.commit_mode.value, PHASES)
    with pytest.raises(RefitFailed) as failed, \
            transaction(subject.engine, run, subject.plan, restore=Restore.STALE) as tx:
        for bucket in subject.refits(1)[:2]:  # the second bucket is through when the trainer stops
            tx.load(bucket)
        raise Interrupted("the trainer stopped")
    report = failed.value.report
    outcome, state = settles_to("bucket:1", subject, Restore.STALE)
    assert (report.outcome, report.engine_state) == (outcome, state.value), report.error
    assert report.error is not None and "Interrupted: the trainer stopped" in report.error
    assert isinstance(failed.value.__cause__, Interrupted)
    if state is EngineState.STALE:
        assert subject.refuses_to_serve()
    else:
        assert rs.same_bits(subject.weights(), previous) and not subject.refuses_to_serve()
    with pytest.raises(RuntimeError, match="no result"):
        _ = tx.result
    assert refit(subject, 2, Restore.STALE).ok  # the next refit recovers


@attrs.frozen
class WithPeers:
    """The agreement of a side whose peers wait at every agreement (every one of them fine)."""

    peers = True

    def agree(self, step: str, status: RankStatus) -> tuple[RankStatus, ...]:
        return (status, RankStatus(1, Role.TRAINER, fingerprint=status.fingerprint))


@pytest.mark.parametrize("kind", ["reference-transactional", "reference-per-layer"])
def test_a_side_with_peers_that_raises_in_the_block_settles_alone_and_re_raises(kind: str, subjects: Any) -> None:
    subject = subjects(kind)
    assert refit(subject, 0, Restore.STALE).ok
    previous = subject.weights()
    run = RefitRun(2, describe_plan(subject.plan), BUCKET, subject.engine.commit_mode.value, PHASES)
    tx = transaction(subject.engine, run, subject.plan, agreement=WithPeers(), restore=Restore.STALE)
    timeout = CollectiveTimeout(0, "staged", 1.0, (1,))
    with pytest.raises(CollectiveTimeout) as raised, tx:
        assert tx.begun
        tx.load(subject.refits(1)[0])
        raise timeout  # the peers' positions are unknown: no later agreement
    assert raised.value is timeout and tx.broken == "CollectiveTimeout at 'staged'"
    outcome, state = settles_to("bucket:1", subject, Restore.STALE)
    assert timeout.report is not None  # this side's report, on the exception that ended it
    assert (timeout.report.outcome, timeout.report.engine_state) == (outcome, state.value)
    if state is EngineState.STALE:
        assert subject.refuses_to_serve()
    else:
        assert rs.same_bits(subject.weights(), previous)
