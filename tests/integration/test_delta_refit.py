"""Delta refits on the reference engine: over training-like steps the engine's bytes equal a full
refit's of the same weights, and every fallback (engine restart, a base copy that differs or was
corrupted, a failed refit, full_every) sends a full refit and says why."""

from __future__ import annotations

import attrs
import pytest
import torch

from adapters.memory.faults import FaultScript
from adapters.memory.faulty import ScriptedFaultyEngine
from adapters.reference.config import MICRO_MOE
from adapters.reference.engine import ReferenceEngine
from adapters.reference.trainer import AdamLikeSteps
from app.services.refit import RefitService
from domain.errors import ConfigError, RefitFailed
from domain.quant.plan import QuantizationPlan
from domain.refit.delta_sync import DeltaSender
from domain.refit.report import RefitOutcome
from domain.refit.session import CommitMode
from tests import refit_support as rs
from tests.refit_support import one_thread  # noqa: F401  (autouse fixture)

PLANS = {
    "bf16": QuantizationPlan.bf16(),
    "fp8_block+nvfp4": rs.DEFAULT_PLAN,
    "mxfp8": QuantizationPlan.from_presets(linear="MXFP8", moe="MXFP8"),
}


def _pair(plan: QuantizationPlan, sender: DeltaSender | None = None, **engine_kw: object
          ) -> tuple[RefitService, RefitService, AdamLikeSteps]:
    """A delta service and a full service fed by one trainer, and the trainer's optimizer."""
    trainer = rs.trainer()
    delta = RefitService(trainer, ReferenceEngine(MICRO_MOE, plan, **engine_kw), plan, bucket_bytes=rs.SMALL_BUCKET,
                         delta=sender or DeltaSender(full_every=100))
    full = RefitService(trainer, ReferenceEngine(MICRO_MOE, plan), plan, bucket_bytes=rs.SMALL_BUCKET)
    return delta, full, AdamLikeSteps.of(trainer.weights.values())


def _same_engines(a: object, b: object) -> bool:
    """Two services' (or engines') live weights, bit for bit."""
    wa, wb = (getattr(x, "engine", x).live_weights() for x in (a, b))
    return rs.same_bits(rs.bits(wa), rs.bits(wb))


@pytest.mark.parametrize("commit_mode", [CommitMode.TRANSACTIONAL, CommitMode.PER_LAYER])
@pytest.mark.parametrize("name", list(PLANS))
def test_delta_refits_give_the_bytes_of_full_refits(name, commit_mode):
    delta, full, adam = _pair(PLANS[name], commit_mode=commit_mode)
    modes = []
    for step in range(4):
        if step:
            adam.step_(seed=step, lr=1e-5)
        report = delta.refit()
        full.refit()
        assert _same_engines(delta, full), f"step {step}: the delta engine differs from the full one"
        modes.append(report.delta.mode)
        assert report.delta.full_bytes == full.reports[-1].bytes_sent
    assert modes == ["full", "delta", "delta", "delta"]
    last = delta.reports[-1].delta
    assert last.tensors_delta > 0 and last.wire_bytes < last.full_bytes / 2
    assert delta.reports[-1].bytes_sent == last.wire_bytes
    assert last.trainer_host_bytes == last.engine_host_bytes == last.full_bytes  # both keep the model's bytes


def test_an_unchanged_model_sends_headers_only():
    delta, _full, _ = _pair(rs.DEFAULT_PLAN)
    delta.refit()
    report = delta.refit().delta
    assert report.mode == "delta" and report.tensors_delta > 0 and report.wire_bytes < report.full_bytes / 20


def test_first_refit_is_full_and_says_why():
    delta, _, _ = _pair(rs.DEFAULT_PLAN)
    first = delta.refit().delta
    assert first.mode == "full" and "first refit" in first.why_full and first.tensors_delta == 0


def test_full_every_forces_a_full_refit():
    delta, full, adam = _pair(rs.DEFAULT_PLAN, DeltaSender(full_every=3))
    modes, whys = [], []
    for step in range(7):
        adam.step_(seed=step, lr=1e-5)
        r = delta.refit().delta
        full.refit()
        modes.append(r.mode)
        whys.append(r.why_full)
        assert _same_engines(delta, full)
    assert modes == ["full", "delta", "delta", "full", "delta", "delta", "full"]
    assert whys[3] == "full_every=3 reached"


def test_a_restarted_engine_gets_a_full_refit():
    delta, full, adam = _pair(rs.DEFAULT_PLAN)
    delta.refit()
    delta.engine = ReferenceEngine(MICRO_MOE, rs.DEFAULT_PLAN)  # the engine restarted: an empty copy
    adam.step_(seed=1, lr=1e-5)
    r = delta.refit().delta
    full.refit()
    assert r.mode == "full" and "holds no base copy" in r.why_full
    assert _same_engines(delta, full)
    assert delta.refit().delta.mode == "delta"


def test_an_engine_whose_copy_differs_gets_a_full_refit():
    delta, full, adam = _pair(rs.DEFAULT_PLAN)
    delta.refit()
    other = RefitService(rs.trainer(seed=7), delta.engine, rs.DEFAULT_PLAN, bucket_bytes=rs.SMALL_BUCKET,
                         delta=DeltaSender())
    other.refit()  # another trainer refitted the engine in between: its copy is that trainer's
    adam.step_(seed=1, lr=1e-5)
    r = delta.refit().delta
    full.refit()
    assert r.mode == "full" and "differs from the trainer's" in r.why_full
    assert _same_engines(delta, full)


@pytest.mark.parametrize("commit_mode", [CommitMode.TRANSACTIONAL, CommitMode.PER_LAYER])
def test_a_corrupted_base_copy_sends_the_same_refit_whole(commit_mode):
    delta, full, adam = _pair(rs.DEFAULT_PLAN, commit_mode=commit_mode)
    delta.refit()
    full.refit()
    before = rs.bits(delta.engine.live_weights())
    copy = delta.engine.delta_receiver.tensors
    name = next(n for n in copy if n.endswith(".weight") and copy[n].dtype == torch.float8_e4m3fn)
    copy[name].view(torch.uint8).reshape(-1)[-1] ^= 0x01  # one bit of the engine's copy flips
    assert rs.same_bits(rs.bits(delta.engine.live_weights()), before)  # the served weights are intact
    adam.step_(seed=1, lr=1e-6)
    report = delta.refit()  # no RefitFailed: the refused delta is retried whole within the call
    full.refit()
    assert report.outcome is RefitOutcome.LIVE and report.delta.mode == "full"
    assert "refused refit 2's delta" in report.delta.why_full and "base copy was corrupted" in report.delta.why_full
    assert name in report.delta.why_full and "the same refit sent whole" in report.delta.why_full
    failed = delta.reports[-2]  # the refused attempt is on record, settled like any failed refit
    assert failed.delta.mode == "delta" and name in failed.error
    if commit_mode is CommitMode.TRANSACTIONAL:
        assert failed.outcome is RefitOutcome.ROLLED_BACK
    else:  # never mixed: a per-layer engine that wrote layers went stale, then the whole refit
        assert failed.outcome in (RefitOutcome.ROLLED_BACK, RefitOutcome.STALE)
    assert _same_engines(delta, full) and not delta.engine.is_stale
    assert delta.engine.delta_base().digest == delta.delta.digest()  # copies agree again
    adam.step_(seed=2, lr=1e-6)
    r = delta.refit().delta
    full.refit()
    assert r.mode == "delta" and _same_engines(delta, full)


def test_only_a_refused_delta_is_retried():
    """A delta refit that fails for another reason (the engine's bucket load) raises as before,
    once, and the next refit is full."""
    delta, full, adam = _pair(rs.DEFAULT_PLAN)
    delta.refit()
    full.refit()
    delta.engine = ScriptedFaultyEngine(delta.engine, FaultScript.parse("bucket:0"))
    adam.step_(seed=1, lr=1e-6)
    count = len(delta.reports)
    with pytest.raises(RefitFailed) as failed:
        delta.refit()
    assert failed.value.report.delta.mode == "delta" and len(delta.reports) == count + 1


def test_a_failed_refit_drops_both_copies_and_the_next_is_full():
    plan = rs.DEFAULT_PLAN
    delta, full, adam = _pair(plan)
    delta.engine = ScriptedFaultyEngine(delta.engine, attrs.evolve(FaultScript.parse("bucket:0"), after=1))
    delta.refit()
    full.refit()
    adam.step_(seed=1, lr=1e-5)
    with pytest.raises(RefitFailed):
        delta.refit()
    assert delta.delta.host_bytes == 0 and delta.engine.delta_base().digest is None
    r = delta.refit().delta
    full.refit()
    assert r.mode == "full" and "previous refit failed" in r.why_full and _same_engines(delta, full)


def test_tensors_past_the_cap_go_whole_and_are_not_kept():
    cap = 64 << 10
    delta, full, adam = _pair(rs.DEFAULT_PLAN, DeltaSender(full_every=100, max_host_bytes=cap))
    delta.refit()
    adam.step_(seed=1, lr=1e-5)
    r = delta.refit().delta
    full.refit()
    assert _same_engines(delta, full)
    assert 0 < r.trainer_host_bytes <= cap and r.engine_host_bytes == r.trainer_host_bytes
    assert r.tensors_whole > 0 and r.tensors_delta > 0


def test_an_engine_without_a_receiver_is_refused():
    from adapters.memory import RecordingEngine

    with pytest.raises(ConfigError, match="layout_delta needs an engine with a delta receiver"):
        RefitService(rs.trainer(), RecordingEngine({}), rs.DEFAULT_PLAN, delta=DeltaSender())


MICRO = ["reference.model=micro-moe", "rollout.quantization.linear=FP8_BLOCK", "rollout.quantization.moe=NVFP4"]


def test_bootstrap_builds_a_delta_service_from_the_configuration():
    from app.bootstrap import bootstrap

    services = bootstrap(overrides=[*MICRO, "rollout.checkpoint_engine.backend=layout_delta",
                                    "rollout.checkpoint_engine.delta.full_every=4",
                                    "rollout.checkpoint_engine.delta.max_host_bytes=1000000"])
    svc = services.refit_service()
    assert svc.delta is not None and svc.delta.full_every == 4 and svc.delta.max_host_bytes == 1_000_000
    assert svc.refit().delta.mode == "full" and svc.refit().delta.mode == "delta"
    assert bootstrap(overrides=MICRO).refit_service().delta is None  # the default backend sends full refits


@pytest.mark.parametrize(("override", "match"), [
    ("rollout.checkpoint_engine.delta.full_every=0", "full_every: must be 1 or more"),
    ("rollout.checkpoint_engine.delta.max_host_bytes=-1", "max_host_bytes: must be 0 or more"),
])
def test_bad_delta_keys_are_refused_by_name(override, match):
    from app.bootstrap import bootstrap

    with pytest.raises(ConfigError, match=match):
        bootstrap(overrides=[*MICRO, "rollout.checkpoint_engine.backend=layout_delta", override])


def test_the_distributed_refit_refuses_layout_delta():
    from app.bootstrap import bootstrap

    services = bootstrap(overrides=[*MICRO, "rollout.checkpoint_engine.backend=layout_delta"])
    with pytest.raises(ConfigError, match="layout_delta runs on the single-process refit"):
        services.world.distributed_refit(None, 0)  # type: ignore[arg-type]


def test_quantized_full_sync_accepts_layout_delta_and_still_refuses_verls_delta_backends():
    from domain.errors import QuantizedDeltaSync
    from domain.quant.rules import check_sync_backend

    check_sync_backend(True, backend="layout_delta", wire_format="bucketed")
    check_sync_backend(False, backend="layout_delta", wire_format="bucketed")
    with pytest.raises(QuantizedDeltaSync, match="dispatch rule QuantizedFullSync"):
        check_sync_backend(True, backend="delta_sharded", wire_format="bucketed")
    with pytest.raises(QuantizedDeltaSync, match="dispatch rule QuantizedFullSync"):
        check_sync_backend(True, backend="layout_delta", wire_format="delta_flush")


def test_layout_delta_refuses_to_restore_by_replay():
    with pytest.raises(ConfigError, match="cannot restore by replaying"):
        RefitService(rs.trainer(), ReferenceEngine(MICRO_MOE, rs.DEFAULT_PLAN), rs.DEFAULT_PLAN,
                     restore="replay", delta=DeltaSender())


def test_an_engine_that_cannot_say_its_base_gets_a_full_refit():
    delta, full, adam = _pair(rs.DEFAULT_PLAN)
    delta.refit()

    class Mute:  # the engine, except that it cannot say its base (the receiver itself still works)
        def __init__(self, inner: ReferenceEngine) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

        def delta_base(self) -> object:
            raise RuntimeError("the engine host does not answer")

    delta.engine = Mute(delta.engine)
    adam.step_(seed=1, lr=1e-5)
    r = delta.refit().delta
    full.refit()
    assert r.mode == "full" and "holds no base copy" in r.why_full
    assert _same_engines(delta.engine.inner, full)


def test_the_delta_bench_measures_fewer_bytes_than_full_refits(capsys):
    from app.bench.delta_refit import run
    from app.cli.main import main

    report = run(quick=True)
    wire = [r for r in report.rows if r.metric == "bytes on the wire"]
    assert len(wire) == 2 * (4 + 3)  # per lr: BF16 against itself, three formats against theirs and BF16
    assert all(r.ratio is not None and r.ratio > 1 for r in wire)
    assert main(["bench", "codecs", "--delta"]) == 2
    assert "--delta goes with the refit suite (refit bench refit --delta)" in capsys.readouterr().err
