"""The demo's run: training-like steps on the embedded model, a refit and a mismatch probe per arm.

Every arm (the chosen plan, BF16, and with `presets` one arm per low-precision preset) has its own
reference engine; all arms share one trainer, so at each step they receive the same weights.
Step 0 is the initial weight sync; steps 1..N first perturb the trainer's weights.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from app.services.mismatch_probe import MismatchProbe, ProbeResult, response_mask, token_batch
from app.services.refit import RefitService
from domain.errors import EngineBusy, EngineStale, RefitFailed
from domain.quant.plan import QuantizationPlan
from domain.refit.report import RefitReport

PRESET_ARMS = ("FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4")


def check_steps(steps: int, inject_fault: str | None, fault_step: int) -> None:
    """A demo's step count and the step its injected fault hits (ValueError naming the option)."""
    if steps < 0:
        raise ValueError(f"--steps must be >= 0, got {steps}")
    if inject_fault and not 0 <= fault_step <= steps:
        raise ValueError(f"--fault-step must be in [0, {steps}] (the steps run), got {fault_step}")


@attrs.frozen
class DemoSettings:
    """What `refit demo` runs.

    Attributes:
        plan: the rollout quantization plan under test.
        model: reference model preset, or a checkpoint directory (`--model DIR`).
        seed: seed of the trainer's weights and of the token batch.
        steps: training-like steps after the initial sync.
        commit_mode: the engines' commit mode.
        bucket_megabytes: bucket capacity, MiB.
        inject_fault: `bucket:K`, `finalize` or `verify` on the plan's arm, or None.
        fault_step: the step whose refit the fault hits.
        presets: add one arm per low-precision preset (linear = moe = preset).
        step_scale: size of each training-like step, relative to each weight's spread.
        batch: sequences in the probe batch.
        seq_len: tokens per sequence.
        prompt_len: prompt tokens (the rest is the scored response).
        lora_rank: a LoRA adapter of this rank on the trainer, the only weights the steps move (0: none).
        lora_sync: how its refits reach the engines: merged or adapter (`actor.lora.sync`).
    """

    plan: QuantizationPlan = attrs.field(factory=lambda: QuantizationPlan.from_presets(linear="FP8_BLOCK", moe="NVFP4"))
    model: str = "tiny-moe"
    seed: int = 0
    steps: int = 3
    commit_mode: str = "transactional"
    bucket_megabytes: float = 1.0
    inject_fault: str | None = None
    fault_step: int = 1
    presets: bool = False
    step_scale: float = 0.02
    batch: int = 4
    seq_len: int = 64
    prompt_len: int = 16
    lora_rank: int = 0
    lora_sync: str = "merged"

    def __attrs_post_init__(self) -> None:
        check_steps(self.steps, self.inject_fault, self.fault_step)
        if self.lora_rank < 0:
            raise ValueError(f"--lora must be a positive rank, got {self.lora_rank}")


@attrs.frozen
class StepRecord:
    """One arm's refit and probe at one step.

    Attributes:
        arm: the arm's label.
        step: 0 = initial sync.
        report: the refit's report (failed refits included).
        probe: the mismatch, or None when the engine refused to serve.
        serving: "yes", or "no (stale)" / "no (busy)" when the engine refused.
        weights_unchanged: after a failed refit, whether live weights are bit-identical to before.
    """

    arm: str
    step: int
    report: RefitReport
    probe: ProbeResult | None
    serving: str
    weights_unchanged: bool | None = None

    def to_dict(self) -> dict[str, object]:
        return {
            "arm": self.arm, "step": self.step, "refit": self.report.to_dict(),
            "mismatch": self.probe.to_dict() if self.probe else None, "serving": self.serving,
            "weights_unchanged": self.weights_unchanged,
        }


@attrs.frozen
class DemoResult:
    settings: DemoSettings
    arms: tuple[str, ...]
    parameters: int
    records: tuple[StepRecord, ...]
    fault_fired: bool | None

    def of(self, arm: str) -> list[StepRecord]:
        return [r for r in self.records if r.arm == arm]


def arm_label(plan: QuantizationPlan) -> str:
    """A short name for a plan: `FP8_BLOCK/NVFP4` (linear/moe), `MXFP8`, `BF16`."""
    label = plan.linear.name if plan.linear == plan.moe else f"{plan.linear.name}/{plan.moe.name}"
    if plan.moe_activation is not None:
        label += f" (moe act {plan.moe_activation.value})"
    return label


def _arms(settings: DemoSettings) -> dict[str, QuantizationPlan]:
    plan = settings.plan
    arms = {arm_label(plan): plan}
    arms.setdefault("BF16", QuantizationPlan.bf16())
    if settings.presets:
        for name in PRESET_ARMS:
            p = QuantizationPlan.from_presets(linear=name, moe=name)
            if p != plan:
                arms[name] = p
    return arms


def _bits(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().reshape(-1).view(torch.uint8).clone() for n, t in weights.items()}


# Builds one arm's refit service: (plan, trainer shared by every arm or None for the first arm,
# the fault to inject on this arm or None) -> RefitService. The composition root provides it.
ArmFactory = Callable[[QuantizationPlan, object | None, str | None], RefitService]


def run_demo(settings: DemoSettings, build_arm: ArmFactory,
             on_record: Callable[[StepRecord], None] | None = None) -> DemoResult:
    """Run the demo.

    Args:
        settings: what to run.
        build_arm: makes each arm's refit service (the first arm builds the trainer the others share).
        on_record: called with each StepRecord as soon as it exists (for live output).

    Returns:
        The DemoResult.
    """
    arms = _arms(settings)
    first = next(iter(arms))
    services: dict[str, RefitService] = {}
    trainer = None
    for label, plan in arms.items():
        svc = build_arm(plan, trainer, settings.inject_fault if label == first else None)
        trainer = svc.trainer
        services[label] = svc
    ids = token_batch(trainer.config.vocab_size, settings.batch, settings.seq_len, settings.seed + 10_000)  # type: ignore[union-attr]
    mask = response_mask(settings.batch, settings.seq_len, settings.prompt_len)
    records: list[StepRecord] = []
    for step in range(settings.steps + 1):
        if step:
            trainer.perturb_(settings.seed * 1_000 + step, settings.step_scale)  # type: ignore[union-attr]
        for label, svc in services.items():
            record = _step(label, step, svc, ids, mask, watch=bool(settings.inject_fault) and label == first)
            records.append(record)
            if on_record is not None:
                on_record(record)
    fired = None
    if settings.inject_fault:
        fired = getattr(services[first].engine, "fired", 0) > 0
    params = trainer.config.num_parameters()  # type: ignore[union-attr]
    return DemoResult(settings, tuple(arms), params, tuple(records), fired)


def _step(label: str, step: int, svc: RefitService, ids: torch.Tensor, mask: torch.Tensor, watch: bool) -> StepRecord:
    before = _bits(dict(svc.engine.live_weights())) if watch else None
    unchanged = None
    try:
        report = svc.refit()
    except RefitFailed as err:
        report = err.report
        if before is not None:
            after = _bits(dict(svc.engine.live_weights()))
            unchanged = before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    try:
        probe = MismatchProbe(svc.trainer, svc.engine).probe(ids, mask)
        serving = "yes"
    except EngineStale:
        probe, serving = None, "no (stale)"
    except EngineBusy:
        probe, serving = None, "no (busy)"
    return StepRecord(label, step, report, probe, serving, unchanged)
