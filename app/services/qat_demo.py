"""`refit demo qat`: a few training steps with QAT and without, and the rollout mismatch of each.

Two copies of the embedded reference model start from the same weights and train on the same
synthetic task (next token = a fixed random permutation of the current token), one plainly in
BF16, one with QAT (`build_qat_backend`, reference backend) in the rollout's preset. After every
step each copy is refitted into a rollout engine that serves that preset, and the trainer's
log-probs are compared with the engine's on a fixed evaluation batch (k3 KL, docs/qat.md).

Two engine shapes (docs/qat.md, "On the real engine"):
- engines of their own (the embedded engine): one per arm, and the BF16 copy is also refitted
  into a BF16 engine, the BF16 level of the mismatch;
- one engine (`one_engine`, an engine in this process that owns the process's state, so
  there is only one: adapters.engine_plugin.DemoDefaults.one_per_process): both arms are refitted into it in turn, each scored right after its own
  refit; no BF16 engine, so no BF16 level. An engine that does not start where the support
  matrix says its build cannot serve the plan (a cell not served on this CPU) is reported with
  the engine's own reason instead of a measurement.
Numbers are measured and printed, never asserted as timings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from app.services.mismatch_probe import response_mask
from app.services.qat_setup import QatSession
from app.services.refit import RefitService
from app.services.transaction import describe_plan
from domain.errors import RefitError
from domain.mismatch import mismatch_metrics, verl_metrics
from domain.quant.plan import QuantizationPlan
from domain.quant.support import CPU_SERVED
from ports.rollout_engine import RolloutEngine
from ports.trainer_model import TrainerModel


class _Embedded(Protocol):
    def module(self) -> torch.nn.Module:
        """A new trainable copy of the embedded reference model (same seed every time)."""
        ...


class _TrainerSide(Protocol):
    def qat(self, model: torch.nn.Module) -> QatSession | None:
        """QAT applied to `model` per the configuration."""
        ...


class QatDemoServices(Protocol):
    """What the QAT demo needs from the composition root (app.bootstrap.Services has it), for a
    configuration whose rollout and QAT are both in the demo's preset."""

    @property
    def embedded(self) -> _Embedded: ...

    @property
    def trainer_side(self) -> _TrainerSide: ...

    def refit_service(self, *, plan: QuantizationPlan | None = None, trainer: TrainerModel | None = None,
                      engine: RolloutEngine | None = None) -> RefitService:
        """A refit service from `trainer` into `engine`, or into a new engine serving `plan`."""
        ...

    def rollout_engine(self, plan: QuantizationPlan | None = None) -> RolloutEngine:
        """A new engine serving `plan` (`one_engine`)."""
        ...

ARMS = ("bf16", "qat")


def synthetic_batch(perm: torch.Tensor, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """Token sequences where every next token is `perm[current]`: int64 [batch, seq_len].

    Args:
        perm: a permutation of the vocabulary.
        batch: sequences.
        seq_len: tokens per sequence.
        seed: seed of the first tokens.

    Returns:
        The token ids.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(batch, seq_len, dtype=torch.int64)
    ids[:, 0] = torch.randint(0, perm.numel(), (batch,), generator=g)
    for t in range(1, seq_len):
        ids[:, t] = perm[ids[:, t - 1]]
    return ids


def _loss(module: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = module(ids)[:, :-1]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    return nll.reshape(mask.shape)[mask].mean()


def run_qat_demo(
    services: QatDemoServices,
    *,
    mode: str = "NVFP4",
    model: str = "tiny-moe",
    steps: int = 3,
    seed: int = 0,
    lr: float = 3e-3,
    batch: int = 4,
    seq_len: int = 32,
    prompt_len: int = 8,
    one_engine: bool = False,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Train two copies of the embedded model, with and without QAT; measure the rollout mismatch.

    Args:
        services: the composition root's services, configured for `mode` and `model`.
        mode: the preset QAT trains in and the rollout serves (for the report).
        model: the embedded model preset (for the report).
        steps: optimizer steps (step 0 is the initial sync).
        seed: seed of the weights and the task.
        lr: AdamW learning rate.
        batch, seq_len, prompt_len: the shape of each batch; the loss and the probe cover the
            tokens after the prompt.
        one_engine: refit both arms into one engine in turn (an engine in this process), and
            start no BF16 engine; otherwise an engine per arm and a BF16 one.
        on_step: called with each record as soon as it exists.

    Returns:
        {"mode", "model", "steps", "plan", "qat_layers", "served", "not_served", "records":
        [{"step", "arm", "train_loss", "k3_quantized", "rollout_corr/k3_kl", "k3_bf16",
        "rollout_nll"}], "final": {...}, "mean": {...}}; k3_bf16 only on the BF16 arm of the
        engines of their own; "mean" averages every probed step (0..steps). When the engine did
        not start (see the module docstring), "served" is False, "not_served" holds its reason
        and there are no records.
    """
    if steps < 0:
        raise ValueError(f"--steps must be >= 0, got {steps}")
    modules = {arm: services.embedded.module() for arm in ARMS}
    session = services.trainer_side.qat(modules["qat"])
    if session is None:  # the configuration enables QAT
        raise RuntimeError("the configuration does not enable QAT (actor.megatron.qat.enable)")
    plan = session.rollout_plan
    head = {"mode": mode, "model": model, "steps": steps, "plan": describe_plan(plan),
            "qat_layers": len(session.summary.quantized)}
    engine: RolloutEngine | None = None
    if one_engine:
        try:
            engine = services.rollout_engine(plan)
        except (RefitError, ImportError):  # rl-refit's own refusal, or the engine's package missing
            raise
        except Exception as err:  # the engine's own failure to start: reported where the matrix expects it
            reason = not_served_reason(services, plan, err)
            return {**head, "served": False, "not_served": reason, "records": [], "final": None, "mean": None}
    built: list[RefitService] = []
    try:
        quantized = {arm: services.refit_service(plan=plan, trainer=_trainer(modules[arm]), engine=engine)
                     for arm in ARMS}
        built += quantized.values()
        bf16 = None if one_engine else services.refit_service(plan=QuantizationPlan.bf16(),
                                                              trainer=_trainer(modules["bf16"]))
        built += [bf16] if bf16 is not None else []
        records = _train(modules, session, quantized, bf16, steps=steps, seed=seed, lr=lr, batch=batch,
                         seq_len=seq_len, prompt_len=prompt_len, on_step=on_step)
    finally:
        _close({id(e): e for e in [*(s.engine for s in built), *([engine] if engine else [])]}.values())
    last = {r["arm"]: r for r in records if r["step"] == steps}
    return {
        **head, "served": True, "not_served": None, "records": records,
        "final": {"k3_quantized_without_qat": last["bf16"]["k3_quantized"],
                  "k3_quantized_with_qat": last["qat"]["k3_quantized"],
                  "k3_bf16_level": last["bf16"]["k3_bf16"]},
        "mean": {"k3_quantized_without_qat": _mean(records, "bf16", "k3_quantized"),
                 "k3_quantized_with_qat": _mean(records, "qat", "k3_quantized"),
                 "k3_bf16_level": None if bf16 is None else _mean(records, "bf16", "k3_bf16")},
    }


def _train(modules: dict[str, torch.nn.Module], session: QatSession, quantized: dict[str, RefitService],
           bf16: RefitService | None, *, steps: int, seed: int, lr: float, batch: int, seq_len: int,
           prompt_len: int, on_step: Callable[[dict[str, Any]], None] | None) -> list[dict[str, Any]]:
    vocab_size = int(getattr(modules["qat"], "config").vocab_size)  # noqa: B009  (the embedded model's shapes)
    optimizers = {arm: torch.optim.AdamW(modules[arm].parameters(), lr=lr, weight_decay=0.0) for arm in ARMS}
    perm = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed + 7))
    mask = response_mask(batch, seq_len, prompt_len)
    eval_ids = synthetic_batch(perm, batch, seq_len, seed + 1)
    records: list[dict[str, Any]] = []
    for step in range(steps + 1):
        losses: dict[str, float | None] = dict.fromkeys(ARMS)
        if step:
            for arm in ARMS:
                loss = _loss(modules[arm], synthetic_batch(perm, batch, seq_len, seed + 100 + step), mask)
                loss.backward()
                optimizers[arm].step()
                optimizers[arm].zero_grad(set_to_none=True)
                losses[arm] = float(loss.detach())
            session.refresh()
        for arm in ARMS:
            record = _probe(step, arm, modules[arm], quantized[arm], bf16 if arm == "bf16" else None, eval_ids, mask)
            record["train_loss"] = losses[arm]
            records.append(record)
            if on_step is not None:
                on_step(record)
    return records


def _close(engines: Iterable[RolloutEngine]) -> None:
    for engine in engines:
        close = getattr(engine, "close", None)
        if close is not None:
            close()


def _mean(records: list[dict[str, Any]], arm: str, key: str) -> float:
    values = [r[key] for r in records if r["arm"] == arm]
    return sum(values) / len(values)


def not_served_reason(services: Any, plan: QuantizationPlan, err: Exception) -> str:
    """Why an engine that failed to start with `err` cannot serve `plan` here: the plan's cells
    that the engine's build does not serve on this machine (support matrix: not marked served on
    CPU, and no GPU), and the engine's own error. Re-raises `err` when every cell should have
    started (then its failure is a bug, not a limit of the machine)."""
    table = services.engine_profile().support
    layout = services.plan_report(plan=plan).resolution.layout
    cells = [] if table is None or torch.cuda.is_available() else [
        v.cell.describe() for v in table.check(plan, layout) if CPU_SERVED not in v.how]
    if not cells:
        raise err
    return (f"{services.config.rollout.name}'s CPU build does not serve {', '.join(cells)} (docs/support-matrix.md); "
            f"starting the engine failed with {type(err).__name__}: {' '.join(str(err).split())}")


def _probe(step: int, arm: str, module: torch.nn.Module, svc: RefitService, bf16: RefitService | None,
           ids: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """Refit the arm into its engine and compare the trainer's log-probs (its own forward) with the
    engine's right away (with one engine, the other arm's refit comes after)."""
    old, _ = _ModuleScorer(module).log_probs(ids)
    svc.refit()
    new, _ = svc.engine.log_probs(ids)
    record: dict[str, Any] = {"step": step, "arm": arm, "k3_quantized": mismatch_metrics(old, new, mask).k3_kl,
                              "rollout_corr/k3_kl": verl_metrics(old, new, mask)["rollout_corr/k3_kl"],
                              "rollout_nll": float(-new[mask].mean()), "k3_bf16": None}
    if bf16 is not None:
        bf16.refit()
        record["k3_bf16"] = mismatch_metrics(old, bf16.engine.log_probs(ids)[0], mask).k3_kl
    return record


def _trainer(module: torch.nn.Module) -> TrainerModel:
    return module.trainer()  # type: ignore[operator]


class _ModuleScorer:
    """The trainer's log-probs as the training forward computes them (fake-quantized under QAT)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def log_probs(self, input_ids: torch.Tensor, *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        return self.module.log_probs(input_ids, temperature=temperature)  # type: ignore[operator]
