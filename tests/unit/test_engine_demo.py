"""The real-engine demo's loop and its cold-start comparison, over the reference engine: the
refitted engine against a fresh engine loaded from the same export (what `refit demo vllm`
does with vLLM), a fault that must leave the engine refusing, and a refit that serves other bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from safetensors.torch import load_file

from app.bootstrap import Services, bootstrap
from app.services.engine_demo import BACK, EngineDemoSettings, run_engine_demo
from domain.quant.naming import natural_key
from domain.quant.plan import QuantizationPlan
from domain.refit.buckets import pack_buckets
from domain.refit.storage import weight_digest


@attrs.define
class Inspectable:
    """A reference engine (which serves ports.engine_inspection itself) that can be told to corrupt
    its refits, and that records its close."""

    inner: Any
    closed: bool = False
    corrupt: bool = False
    packed: frozenset[str] = frozenset()  # names kept packed outside an emptied tensor, as vLLM's CPU build does

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def finalize_refit(self) -> Any:
        result = self.inner.finalize_refit()
        if self.corrupt:
            live = self.inner.live_weights()
            with torch.no_grad():
                live[next(n for n in live if "lm_head" in n)].mul_(2)
        return result

    def close(self) -> None:
        self.inner.close()
        self.closed = True

    def digests(self) -> dict[str, str]:
        live = self.inner.live_weights()
        return {n: weight_digest(torch.empty(0) if any(p in n for p in self.packed) else t) for n, t in live.items()}


@attrs.define
class Cold(Inspectable):
    """A cold start's view: log-probs alone, as adapters.vllm.launcher.ColdServer returns them."""

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return self.inner.greedy(prompts, max_tokens)

    def log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.inner.log_probs(input_ids)[0]

    def placeholders(self, names: Any) -> frozenset[str]:
        return frozenset()  # the reference engine writes every parameter it has from the export


@attrs.define
class FakeServices:
    """The demo's services over the reference engine; cold starts load the export into a new one."""

    services: Services
    corrupt: bool = False
    packed: frozenset[str] = frozenset()
    cold_starts: int = 0
    engine: Inspectable | None = None

    @property
    def embedded(self) -> FakeServices:
        return self

    @property
    def engines(self) -> FakeServices:
        return self

    def refit_service(self, *, inject_fault: str | None = None, fault_after: int = 0) -> Any:
        self.engine = Inspectable(self.services.rollout_engine(), corrupt=self.corrupt, packed=self.packed)
        svc = self.services.refit_service(engine=self.engine, inject_fault=inject_fault,  # type: ignore[arg-type]
                                          fault_after=fault_after)
        return svc

    def export_trainer(self, trainer: Any, out: str | Path) -> Path:
        return self.services.embedded.export_trainer(trainer, out)

    def cold_start(self, directory: str | Path) -> Inspectable:
        self.cold_starts += 1
        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(Path(directory).glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        engine = self.services.rollout_engine()
        engine.begin_refit(1)
        for bucket in pack_buckets(sorted(tensors.items(), key=lambda kv: natural_key(kv[0])), 1 << 20):
            engine.load_bucket(bucket)
        engine.finalize_refit()
        return Cold(engine, packed=self.packed)


def _services(preset: str | None) -> Services:
    plan = [f"rollout.quantization.linear={preset}", f"rollout.quantization.moe={preset}"] if preset else []
    return bootstrap(overrides=["reference.model=micro-moe", "rollout.checkpoint_engine.update_weights_bucket_megabytes=0.25",
                                *plan])


@pytest.mark.parametrize("preset", [None, "FP8_BLOCK"])
def test_every_refit_equals_a_cold_start_and_identical_exports_start_once(preset: str | None) -> None:
    fake = FakeServices(_services(preset))
    plan = QuantizationPlan.from_presets(preset, preset)
    result = run_engine_demo(EngineDemoSettings(engine="reference", plan=plan, steps=2), fake)  # type: ignore[arg-type]
    assert result.ok and result.refused_before_first_refit
    assert [s.step for s in result.steps] == [0, 1, 2, BACK]
    assert all(s.equals_cold_start and s.logprobs_equal and s.weights_equal and s.tokens_equal for s in result.steps)
    assert fake.cold_starts == 3  # back to step 0's weights: step 0's cold start is reused
    assert fake.engine is not None and fake.engine.closed
    assert result.steps[0].to_dict()["equals_cold_start"] is True


def test_a_failed_refit_must_leave_the_engine_refusing() -> None:
    fake = FakeServices(_services(None))
    settings = EngineDemoSettings(engine="reference", plan=QuantizationPlan.bf16(), steps=2, inject_fault="bucket:1",
                                  fault_step=1)
    result = run_engine_demo(settings, fake)  # type: ignore[arg-type]
    failed = result.steps[1]
    assert not failed.report.ok and failed.equals_cold_start is None
    # the reference engine is transactional: it rolled back and serves its previous weights
    assert failed.report.outcome.value == "rolled-back" and failed.serving == "yes"
    assert result.ok and result.fault_fired
    assert all(s.equals_cold_start for s in result.steps if s.report.ok)


def test_a_stale_engine_that_still_serves_fails_the_demo() -> None:
    fake = FakeServices(_services(None))
    settings = EngineDemoSettings(engine="reference", plan=QuantizationPlan.bf16(), steps=1, back=False,
                                  inject_fault="storage", fault_step=1)
    result = run_engine_demo(settings, fake)  # type: ignore[arg-type]
    assert result.steps[1].report.outcome.value == "stale" and result.steps[1].serving == "no (stale)"
    assert result.ok
    forged = attrs.evolve(result, steps=(result.steps[0], attrs.evolve(result.steps[1], serving="yes")))
    assert not forged.ok


def test_a_refit_serving_other_bytes_is_reported_and_fails_the_demo() -> None:
    fake = FakeServices(_services(None), corrupt=True)
    result = run_engine_demo(EngineDemoSettings(engine="reference", plan=QuantizationPlan.bf16(), steps=0, back=False),
                             fake)  # type: ignore[arg-type]
    (step,) = result.steps
    assert step.report.ok and step.equals_cold_start is False and not result.ok
    assert not step.logprobs_equal and not step.weights_equal
    assert any("lm_head" in name for name in step.differing_weights)


def test_an_engine_that_cannot_be_inspected_is_refused_naming_the_key() -> None:
    from app.services.engine_demo import inspected
    from domain.errors import ConfigError

    services = _services(None)
    engine = services.rollout_engine()
    assert inspected(engine) is engine

    class Opaque:
        pass

    with pytest.raises(ConfigError, match=r"^rollout\.name: .*Opaque does not serve"):
        inspected(Opaque())  # type: ignore[arg-type]


def test_the_reference_engine_serves_greedy_tokens_its_forward_picks_and_refuses_while_stale() -> None:
    from adapters.reference.model import forward_logits
    from domain.errors import EngineStale

    services = _services(None)
    engine = services.rollout_engine()
    with pytest.raises(EngineStale):
        engine.greedy([[1, 2, 3]], 2)
    services.refit_service(engine=engine).refit()
    prompt = [5, 9, 2]
    (tokens,) = engine.greedy([prompt], 3)
    ids = torch.tensor([prompt])
    for token in tokens:  # each token is the argmax of the forward over the prompt and the tokens before it
        logits = forward_logits(engine.config, engine.effective_weights(), ids, engine._act)
        assert token == int(logits[0, -1].argmax())
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    with pytest.raises(ValueError, match=r"greedy: each prompt must be 1 or more token ids"):
        engine.greedy([[]], 1)


@pytest.mark.parametrize("corrupt", [False, True], ids=["same", "corrupted"])
def test_packed_weights_are_listed_as_not_compared_and_the_log_probs_judge_them(corrupt: bool) -> None:
    fake = FakeServices(_services(None), corrupt=corrupt, packed=frozenset({"lm_head", "qkv"}))
    result = run_engine_demo(EngineDemoSettings(engine="reference", plan=QuantizationPlan.bf16(), steps=0, back=False),
                             fake)  # type: ignore[arg-type]
    (step,) = result.steps
    assert step.unreadable and all("lm_head" in n or "qkv" in n for n in step.unreadable)
    assert any("lm_head" in n for n in step.unreadable) and any("qkv" in n for n in step.unreadable)
    assert step.to_dict()["unreadable"] == list(step.unreadable)
    assert not any(n in step.differing_weights for n in step.unreadable)  # never called equal, nor different
    assert step.weights_equal is True  # the readable rest
    # the doubled head is packed: its bytes cannot show it, the log-probs do
    assert step.logprobs_equal is (not corrupt) and step.equals_cold_start is (not corrupt) and result.ok is (not corrupt)
