"""`refit demo lora RANK --sync adapter`: the adapter mode, step after step.

A trainer with a rank-RANK adapter (the embedded model's base, frozen) takes training-like steps
on the adapter only. Each arm (the chosen plan and BF16) has its own engine, serving base +
adapter: step 0 sends the base and the adapter, every later step the adapter alone; the mismatch
probe compares the engine with the trainer's merged model after each step. With an injected fault,
the plan's arm sends its base again at the fault's step, whose base refit the fault hits: the step
goes live in no part (the previous adapter keeps serving on the restored base).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol, runtime_checkable

import attrs
import torch

from app.services.demo import DemoSettings, _arms
from app.services.lora_sync import AdapterUpdateReport, LoraSyncService, LoraTrainerModel
from app.services.mismatch_probe import MismatchProbe, ProbeResult, response_mask, token_batch
from domain.errors import EngineBusy, EngineStale
from domain.quant.plan import QuantizationPlan


@runtime_checkable
class DemoLoraTrainer(LoraTrainerModel, Protocol):
    """The demo's trainer (adapters.reference.lora.LoraTrainer): its merged model's log-probs, its
    vocabulary, and training-like steps on the adapter."""

    @property
    def config(self) -> _Vocab: ...

    def log_probs(self, input_ids: torch.Tensor, *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]: ...

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]: ...

    def perturb_(self, seed: int, scale: float = 0.01) -> None: ...

    def num_bytes(self) -> int: ...


class _Vocab(Protocol):
    @property
    def vocab_size(self) -> int: ...


@attrs.frozen
class LoraStepRecord:
    """One arm's adapter-mode step.

    Attributes:
        arm: the arm's label.
        step: 0 = the first sync (base and adapter).
        report: the step's report.
        probe: the mismatch after it, or None when the engine refused to serve.
        serving: "yes", or "no (stale)" / "no (busy)".
    """

    arm: str
    step: int
    report: AdapterUpdateReport
    probe: ProbeResult | None
    serving: str

    def to_dict(self) -> dict[str, object]:
        return {"arm": self.arm, "step": self.step, "serving": self.serving, **self.report.to_dict(),
                "probe": None if self.probe is None else self.probe.metrics.to_dict()}


@attrs.frozen
class LoraDemoResult:
    """Every step of every arm, and the adapter's and the model's sizes."""

    settings: DemoSettings
    arms: tuple[str, ...]
    records: tuple[LoraStepRecord, ...]
    adapter_bytes: int
    model_bytes: int

    def of(self, arm: str) -> list[LoraStepRecord]:
        return [r for r in self.records if r.arm == arm]


# Builds one arm's adapter-mode service: (plan, the trainer every arm shares or None for the first
# arm, the fault to inject on this arm's base refit or None). The composition root provides it.
LoraArmFactory = Callable[[QuantizationPlan, object | None, str | None], LoraSyncService]


def run_lora_demo(settings: DemoSettings, build_arm: LoraArmFactory,
                  on_record: Callable[[LoraStepRecord], None] | None = None) -> LoraDemoResult:
    """Run the adapter-mode demo (one LoraSyncService per arm, one trainer for all)."""
    arms = _arms(settings)
    first = next(iter(arms))
    services: dict[str, LoraSyncService] = {}
    trainer = None
    for label, plan in arms.items():
        svc = build_arm(plan, trainer, settings.inject_fault if label == first else None)
        trainer = svc.trainer
        services[label] = svc
    lora = services[first].trainer
    if not isinstance(lora, DemoLoraTrainer):
        raise TypeError(f"{type(lora).__name__} cannot take the demo's training-like steps (perturb_)")
    ids = token_batch(lora.config.vocab_size, settings.batch, settings.seq_len, settings.seed + 10_000)
    mask = response_mask(settings.batch, settings.seq_len, settings.prompt_len)
    records: list[LoraStepRecord] = []
    for step in range(settings.steps + 1):
        if step:
            lora.perturb_(settings.seed * 1_000 + step, settings.step_scale)
        for label, svc in services.items():
            # an injected fault hits a base refit: the faulted arm sends its base again at the fault's step
            resend = bool(settings.inject_fault) and label == first and step == settings.fault_step
            report = svc.sync(base_changed=resend)
            try:
                probe, serving = MismatchProbe(lora, svc.base_refit.engine).probe(ids, mask), "yes"
            except EngineStale:
                probe, serving = None, "no (stale)"
            except EngineBusy:
                probe, serving = None, "no (busy)"
            record = LoraStepRecord(label, step, report, probe, serving)
            records.append(record)
            if on_record is not None:
                on_record(record)
    return LoraDemoResult(settings, tuple(arms), tuple(records), lora.adapter.nbytes, lora.num_bytes())
