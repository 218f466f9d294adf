"""The post-refit probe: the engine's log-probs on a fixed batch against a reference after each
commit. It passes a correct refit, and it catches a refit that reported success but serves other
weights (the storage check cannot: the pointers are right), leaving the engine stale until a refit
passes it."""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs
import pytest
import torch

from app.bootstrap import bootstrap
from app.services.verification import (
    ColdStartReference,
    EngineReference,
    PostRefitProbe,
    TrainerReference,
    probe_batch,
)
from domain.errors import ProbeMismatch, RefitFailed
from domain.quant.plan import QuantizationPlan
from domain.refit.probe import TRAINER_BOUNDS, probe_bound
from domain.refit.report import EngineFinalizeResult, ProbeCheck, RefitOutcome

OVERRIDES = ["reference.model=micro-moe", "rollout.checkpoint_engine.update_weights_bucket_megabytes=0.25"]


def test_compare_measures_the_worst_difference() -> None:
    a = torch.tensor([[-1.0, -2.0, -float("inf")]])
    assert ProbeCheck.compare(a, a.clone(), bound=0.0, name="x").max_abs_diff == 0.0  # equal infinities: 0
    worse = torch.tensor([[-1.0, -2.5, -float("inf")]])
    check = ProbeCheck.compare(worse, a, bound=0.25, name="x")
    assert check.max_abs_diff == 0.5 and not check.passed and "FAILED" in str(check)
    assert math.isinf(ProbeCheck.compare(torch.full((1, 3), float("nan")), a, bound=1e9, name="x").max_abs_diff)
    assert math.isinf(ProbeCheck.compare(a[:, :2], a, bound=1e9, name="x").max_abs_diff)


def test_the_bound_is_zero_for_an_engine_way_reference_and_the_widest_format_otherwise() -> None:
    plan = QuantizationPlan.from_presets("FP8_BLOCK", "NVFP4")
    assert probe_bound(plan, engine_way=True) == 0.0
    assert probe_bound(plan, engine_way=False) == TRAINER_BOUNDS["NVFP4"]
    assert probe_bound(QuantizationPlan.bf16(), engine_way=False) == TRAINER_BOUNDS["BF16"]


@attrs.define
class Corrupting:
    """Delegates to a reference engine; after a commit it silently doubles the LM head in place."""

    inner: object
    armed: bool = True

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def finalize_refit(self) -> EngineFinalizeResult:
        result = self.inner.finalize_refit()  # type: ignore[attr-defined]
        if self.armed:
            live: Mapping[str, torch.Tensor] = self.inner.live_weights()  # type: ignore[attr-defined]
            name = next(n for n in live if "lm_head" in n)  # doubles every logit: far beyond any bound
            with torch.no_grad():
                live[name].mul_(2)
        return result


def test_verify_enabled_probes_every_refit_against_the_trainer() -> None:
    services = bootstrap(overrides=[*OVERRIDES, "rollout.verify.enabled=true"])
    svc = services.refit_service()
    assert svc.probe is not None and isinstance(svc.probe.reference, TrainerReference)
    report = svc.refit()
    assert report.probe is not None and report.probe.passed
    assert report.probe.max_abs_diff == 0.0  # the reference engine computes the trainer's way
    assert report.to_dict()["probe"]["passed"] is True


def test_a_silently_wrong_refit_is_caught_and_the_engine_left_stale() -> None:
    services = bootstrap(overrides=OVERRIDES)
    engine = Corrupting(services.rollout_engine())
    trainer = services.trainer_model()
    probe = PostRefitProbe(TrainerReference(trainer), probe_batch(trainer.config.vocab_size))  # type: ignore[attr-defined]
    svc = attrs.evolve(services.refit_service(engine=engine, trainer=trainer), probe=probe)  # type: ignore[arg-type]
    with pytest.raises(RefitFailed) as info:
        svc.refit()
    report = info.value.report
    assert isinstance(info.value.__cause__, ProbeMismatch)
    assert report.outcome is RefitOutcome.STALE and engine.is_stale
    assert report.storage.ok  # the pointers were right: only the probe sees it
    assert report.probe is not None and not report.probe.passed and report.probe.max_abs_diff > report.probe.bound
    engine.armed = False
    assert svc.refit().ok and not engine.is_stale


def test_an_engine_way_reference_allows_no_difference() -> None:
    services = bootstrap(overrides=OVERRIDES)
    trainer = services.trainer_model()
    cold = services.rollout_engine()
    services.refit_service(engine=cold, trainer=trainer).refit()
    probe = PostRefitProbe(EngineReference(cold), probe_batch(trainer.config.vocab_size))  # type: ignore[attr-defined]
    svc = attrs.evolve(services.refit_service(trainer=trainer), probe=probe)
    report = svc.refit()
    assert report.probe is not None and report.probe.bound == 0.0 and report.probe.max_abs_diff == 0.0
    trainer.perturb_(1, 0.02)  # type: ignore[attr-defined]
    with pytest.raises(RefitFailed, match="ProbeMismatch"):  # the reference now holds other weights
        svc.refit()


@pytest.mark.parametrize(("presets", "bound"), [([], 0.0), (["rollout.quantization.linear=FP8_BLOCK"],
                                                           TRAINER_BOUNDS["FP8_BLOCK"])])
def test_the_configured_probe_holds_the_embedded_bf16_engine_to_zero(presets: list[str], bound: float) -> None:
    """The embedded engine computes the trainer's own forward: with BF16 nothing may differ."""
    services = bootstrap(overrides=[*OVERRIDES, "rollout.verify.enabled=true", *presets])
    report = services.refit_service().refit()
    assert report.probe is not None and report.probe.passed and report.probe.bound == bound
    if not presets:
        assert report.probe.max_abs_diff == 0.0


@attrs.frozen
class _Cold:
    """A cold start's shape: log_probs returns the log-probs alone (adapters.vllm.launcher.ColdServer)."""

    engine: object

    def log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.engine.log_probs(input_ids)[0]  # type: ignore[attr-defined]


def test_a_cold_start_reference_allows_no_difference() -> None:
    services = bootstrap(overrides=[*OVERRIDES, "rollout.quantization.linear=FP8_BLOCK"])
    trainer = services.trainer_model()
    cold = services.rollout_engine()
    services.refit_service(engine=cold, trainer=trainer).refit()
    probe = PostRefitProbe(ColdStartReference(_Cold(cold)), probe_batch(trainer.config.vocab_size))  # type: ignore[attr-defined]
    report = attrs.evolve(services.refit_service(trainer=trainer), probe=probe).refit()
    assert report.probe is not None and report.probe.bound == 0.0 and report.probe.max_abs_diff == 0.0
    assert report.probe.reference == "a cold start of the exported checkpoint"
