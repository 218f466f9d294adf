"""The adapter LoRA mode on the embedded engine: each step sends the adapter alone (the base only
when it changed), the engine serves base + adapter, and an update that fails anywhere leaves the
previous adapter serving. The engine merges the adapter into its effective weights, so on a BF16
base it serves exactly the trainer's merged model."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

from adapters.reference.config import MICRO_MOE
from adapters.reference.engine import ReferenceEngine
from adapters.reference.lora import LoraTrainer
from adapters.reference.model import slot_table
from app.bootstrap import bootstrap
from app.services.lora_sync import LoraSyncService
from app.services.refit import RefitService
from domain.errors import AdapterUpdateFailed, ConfigError, EngineStale, LoraShapeMismatch
from domain.lora import WIRE_BUDGET_FACTOR, LoraAdapter, LoraWeights, merge_weight
from domain.lora.sync import StagedAdapter
from domain.quant.codecs import dequantize_weight, quantize_weight
from domain.quant.formats import FORMATS
from domain.quant.plan import QuantizationPlan
from domain.refit.session import CommitMode
from tests import refit_support as rs
from tests.refit_support import one_thread  # noqa: F401  (autouse fixture)

IDS = rs.token_ids()


def _service(plan: QuantizationPlan | None = None, engine: Any = None, *, r: int = 4,
             commit_mode: CommitMode = CommitMode.TRANSACTIONAL, restore: str | None = None) -> LoraSyncService:
    plan = plan or QuantizationPlan.bf16()
    trainer = LoraTrainer.from_seed(rs.trainer(), r=r)
    engine = engine or ReferenceEngine(MICRO_MOE, plan, commit_mode=commit_mode)
    base_refit = RefitService(trainer.base, engine, plan, bucket_bytes=rs.SMALL_BUCKET, restore=restore)
    return LoraSyncService(trainer, engine, base_refit)


def _serves(svc: LoraSyncService) -> torch.Tensor:
    return svc.engine.log_probs(IDS)[0]  # type: ignore[attr-defined]


def test_the_first_step_sends_base_and_adapter_then_only_the_adapter_and_the_engine_serves_the_merged_model():
    svc = _service()
    first = svc.sync()
    assert first.live and first.base is not None and first.base.ok and first.adapter_id == 1
    assert torch.equal(_serves(svc), svc.trainer.log_probs(IDS)[0])  # type: ignore[attr-defined]
    for step in (2, 3, 4):
        svc.trainer.perturb_(step, 0.05)  # type: ignore[attr-defined]
        report = svc.sync()
        assert report.live and report.base is None  # the base did not change: not sent
        assert (report.adapter_id, report.previous_id) == (step, step - 1)
        assert report.bytes_sent == report.adapter_bytes <= WIRE_BUDGET_FACTOR * report.adapter_bytes
        assert torch.equal(_serves(svc), svc.trainer.log_probs(IDS)[0])  # type: ignore[attr-defined]
    assert report.adapter_bytes < first.base.bytes_sent / 10  # an adapter step moves a sliver of the model
    assert set(svc.engine._adapters) == {4}  # type: ignore[attr-defined]  # the previous ids were dropped


def test_a_changed_base_is_sent_again_with_the_adapter():
    svc = _service()
    svc.sync()
    with torch.no_grad():
        for _, t in svc.trainer.base.named_weights():  # type: ignore[attr-defined]
            t.mul_(1.01)
    stale_view = _serves(svc)
    assert not torch.equal(stale_view, svc.trainer.log_probs(IDS)[0])  # type: ignore[attr-defined]
    report = svc.sync(base_changed=True)
    assert report.live and report.base is not None
    assert torch.equal(_serves(svc), svc.trainer.log_probs(IDS)[0])  # type: ignore[attr-defined]


def test_on_a_quantized_base_the_engine_adds_the_adapter_to_the_dequantized_weight():
    plan = QuantizationPlan.from_presets(linear="FP8_BLOCK", moe="FP8_BLOCK")
    svc = _service(plan)
    assert svc.sync().live
    adapter = svc.trainer.adapter  # type: ignore[attr-defined]
    module = "model.layers.0.self_attn.k_proj"
    slot = slot_table(MICRO_MOE)[module]
    base = dict(svc.trainer.base.named_weights())[f"{module}.weight"]  # type: ignore[attr-defined]
    served = dequantize_weight(quantize_weight(FORMATS["FP8_BLOCK"], base), torch.bfloat16)
    expected = merge_weight(module, served, adapter.modules[module], adapter.scaling)
    assert torch.equal(svc.engine.effective_weights()[slot.key][slot.rows], expected)  # type: ignore[attr-defined]


@attrs.define
class FailingStage:
    """The engine, failing an adapter's staging: before any worker holds it, or after it was staged
    (as when the second of two workers fails: the engine drops the id everywhere)."""

    inner: ReferenceEngine
    after_staging: bool = False
    armed: bool = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def serving_adapter(self) -> int | None:
        return self.inner.serving_adapter

    def stage_adapter(self, adapter: LoraAdapter) -> StagedAdapter:
        if not self.armed:
            return self.inner.stage_adapter(adapter)
        self.armed = False
        if self.after_staging:
            staged = self.inner.stage_adapter(adapter)
            self.inner.abort_adapter(staged)
        raise AdapterUpdateFailed("worker 1: out of adapter slots", self.inner.serving_adapter)


@pytest.mark.parametrize("after_staging", [False, True], ids=["before", "after"])
def test_a_stage_that_fails_keeps_the_previous_adapter_serving(after_staging):
    svc = _service()
    assert svc.sync().live
    served = _serves(svc)
    faulty = FailingStage(svc.engine, after_staging=after_staging)  # type: ignore[arg-type]
    svc.engine = faulty  # type: ignore[assignment]
    svc.trainer.perturb_(7, 0.05)  # type: ignore[attr-defined]
    report = svc.sync()
    assert not report.live and report.adapter_id == report.previous_id == 1
    assert "out of adapter slots" in (report.error or "") and "adapter 1 still serves" in (report.error or "")
    assert torch.equal(_serves(svc), served)  # the previous adapter, bit for bit
    assert set(faulty.inner._adapters) == {1}  # nothing staged was left behind
    retry = svc.sync()
    assert retry.live and torch.equal(_serves(svc), svc.trainer.log_probs(IDS)[0])  # type: ignore[attr-defined]


@pytest.mark.parametrize("fault", ["begin", "bucket:2", "finalize", "verify"])
def test_a_base_refit_that_fails_drops_the_staged_adapter_and_the_engine_serves_what_it_did(fault):
    from adapters.memory.faults import FaultScript
    from adapters.memory.faulty import ScriptedFaultyEngine

    svc = _service()
    assert svc.sync().live
    served = _serves(svc)
    engine = ScriptedFaultyEngine(svc.engine, FaultScript.parse(fault))
    svc.engine = engine  # type: ignore[assignment]
    svc.base_refit.engine = engine
    svc.trainer.perturb_(3, 0.05)  # type: ignore[attr-defined]
    report = svc.sync(base_changed=True)
    assert not report.live and report.base is not None and not report.base.ok
    assert report.adapter_id == 1 and "the base refit failed" in (report.error or "")
    assert torch.equal(_serves(svc), served)  # transactional: base and adapter as they were
    assert set(engine.inner._adapters) == {1}  # type: ignore[attr-defined]
    retry = svc.sync()  # the failed base refit is retried with the next step
    assert retry.live and retry.base is not None and retry.base.ok
    assert torch.equal(_serves(svc), svc.trainer.log_probs(IDS)[0])  # type: ignore[attr-defined]


def test_a_per_layer_engine_left_stale_by_the_base_refit_refuses_until_a_step_succeeds():
    from adapters.memory.faults import FaultScript
    from adapters.memory.faulty import ScriptedFaultyEngine

    svc = _service(commit_mode=CommitMode.PER_LAYER, restore="stale")
    assert svc.sync().live
    engine = ScriptedFaultyEngine(svc.engine, FaultScript.parse("bucket:2"))
    svc.engine = engine  # type: ignore[assignment]
    svc.base_refit.engine = engine
    assert not svc.sync(base_changed=True).live
    with pytest.raises(EngineStale):
        _serves(svc)
    assert engine.serving_adapter == 1  # not switched: the step went live in no part
    retry = svc.sync()
    assert retry.live and retry.base is not None
    assert torch.equal(_serves(svc), svc.trainer.log_probs(IDS)[0])  # type: ignore[attr-defined]


def test_the_engine_serves_its_own_copy_of_the_adapter():
    svc = _service()
    assert svc.sync().live
    served = _serves(svc)
    with torch.no_grad():  # the trainer's tensors move after the step (the next optimizer step)
        for w in svc.trainer.adapter.modules.values():  # type: ignore[attr-defined]
            w.lora_B.mul_(3)
    svc.engine._effective = None  # type: ignore[attr-defined]  # recompute from what the engine holds
    assert torch.equal(_serves(svc), served)


def test_an_adapter_that_does_not_fit_the_base_is_refused_before_anything_changes():
    svc = _service()
    assert svc.sync().live
    served = _serves(svc)
    module = "model.layers.0.self_attn.q_proj"
    a = torch.zeros(4, 7, dtype=torch.bfloat16)
    bad = LoraAdapter(r=4, lora_alpha=8, target_modules=("q_proj",),
                      modules={module: LoraWeights(a, torch.zeros(5, 4, dtype=torch.bfloat16))})
    with pytest.raises(AdapterUpdateFailed, match="adapter 1 still serves") as info:
        svc.engine.stage_adapter(bad)
    assert isinstance(info.value.__cause__, LoraShapeMismatch) and module in str(info.value)
    assert torch.equal(_serves(svc), served)


def test_the_composition_root_builds_the_adapter_mode_and_refuses_what_cannot_serve_it():
    services = bootstrap(overrides=["reference.model=micro-moe", "actor.lora.rank=4", "actor.lora.sync=adapter",
                                    "rollout.quantization.linear=null", "rollout.quantization.moe=null"])
    svc = services.lora.sync_service()
    assert isinstance(svc.trainer, LoraTrainer) and svc.trainer.adapter.r == 4
    assert svc.trainer.adapter.scaling == 2.0  # alpha defaults to 2 r
    assert svc.sync().live and svc.sync().base is None
    merged = bootstrap(overrides=["reference.model=micro-moe", "actor.lora.rank=4"])
    with pytest.raises(ConfigError, match=r"actor\.lora\.sync"):
        merged.lora.sync_service()
    assert isinstance(merged.trainer_model(), LoraTrainer)  # merged: the trainer's weights are the merged model
    plain = bootstrap(overrides=["reference.model=micro-moe", "actor.lora.sync=adapter"])
    with pytest.raises(ConfigError, match=r"actor\.lora\.rank"):
        plain.lora.sync_service()


def test_the_bench_measures_the_adapter_mode_against_the_adapter_and_the_merged_mode():
    from app.bench.lora_refit import FORMATS, run

    report = run(quick=True, rank=4)
    adapter = [r for r in report.rows if r.case.endswith(" adapter")]
    by_metric: dict[str, list[Any]] = {}
    for r in adapter:
        by_metric.setdefault(r.metric.split(" (")[0], []).append(r)
    own = by_metric["bytes on the wire per step"]
    assert len(own) == len(FORMATS)
    assert all(r.ratio is not None and r.ratio >= 1 / WIRE_BUDGET_FACTOR for r in own)  # within the 2x budget
    assert all(r.ratio is not None and r.ratio > 5 for r in by_metric["bytes on the wire per step vs merged"])
    bf16 = next(r for r in by_metric["mismatch k3 KL"] if r.preset == "BF16")
    assert bf16.value == 0.0  # the embedded engine serves exactly the merged model on a BF16 base
