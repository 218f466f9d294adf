"""`refit demo --qat`: a few training steps with QAT and without, and the rollout mismatch of each.

Two copies of the embedded reference model start from the same weights and train on the same
synthetic task (next token = a fixed random permutation of the current token), one plainly in
BF16, one with QAT (`build_qat_backend`, reference backend) in the rollout's preset. After every
step each copy is refitted into a rollout engine that serves that preset, and the trainer's
log-probs are compared with the engine's on a fixed evaluation batch (k3 KL, ARCHITECTURE.md
section 9). The BF16 copy is also refitted into a BF16 engine: the BF16 level of the mismatch.
Numbers are measured and printed, never asserted as timings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from app.services.mismatch_probe import MismatchProbe, response_mask
from app.services.qat_setup import QatSession
from app.services.refit import RefitService
from domain.quant.plan import QuantizationPlan
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

    def refit_service(self, *, plan: QuantizationPlan | None = None, trainer: TrainerModel | None = None) -> RefitService:
        """A refit service from `trainer` into a new engine serving `plan`."""
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
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Train two copies of the embedded model, with and without QAT; measure the rollout mismatch.

    Args:
        services: the composition root's services, configured for `mode` and `model`.
        mode: the preset the rollout serves (linear and experts) and QAT trains in (for the report).
        model: the embedded model preset (for the report).
        steps: optimizer steps (step 0 is the initial sync).
        seed: seed of the weights and the task.
        lr: AdamW learning rate.
        batch, seq_len, prompt_len: the shape of each batch; the loss and the probe cover the
            tokens after the prompt.
        on_step: called with each record as soon as it exists.

    Returns:
        {"mode", "model", "qat_layers", "records": [{"step", "arm", "train_loss", "k3_quantized",
        "k3_bf16", "rollout_nll"}], "final": {...}}; k3_bf16 only on the BF16 arm.
    """
    if steps < 0:
        raise ValueError(f"--steps must be >= 0, got {steps}")
    modules = {arm: services.embedded.module() for arm in ARMS}
    session = services.trainer_side.qat(modules["qat"])
    if session is None:  # the configuration enables QAT
        raise RuntimeError("the configuration does not enable QAT (actor.megatron.qat.enable)")
    plan = session.rollout_plan
    quantized = {arm: services.refit_service(plan=plan, trainer=_trainer(modules[arm])) for arm in ARMS}
    bf16 = services.refit_service(plan=QuantizationPlan.bf16(), trainer=_trainer(modules["bf16"]))
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
    last = {r["arm"]: r for r in records if r["step"] == steps}
    return {
        "mode": mode, "model": model, "steps": steps,
        "qat_layers": len(session.summary.quantized),
        "records": records,
        "final": {"k3_quantized_without_qat": last["bf16"]["k3_quantized"],
                  "k3_quantized_with_qat": last["qat"]["k3_quantized"],
                  "k3_bf16_level": last["bf16"]["k3_bf16"]},
    }


def _probe(step: int, arm: str, module: torch.nn.Module, svc: Any, bf16: Any, ids: torch.Tensor,
           mask: torch.Tensor) -> dict[str, Any]:
    """Refit the arm's engines and compare the trainer's log-probs (its own forward) with theirs."""
    trainer_view = _ModuleScorer(module)
    svc.refit()
    result = MismatchProbe(trainer_view, svc.engine).probe(ids, mask)  # type: ignore[arg-type]
    record: dict[str, Any] = {"step": step, "arm": arm, "k3_quantized": result.metrics.k3_kl,
                              "rollout_nll": _nll(svc.engine, ids, mask), "k3_bf16": None}
    if bf16 is not None:
        bf16.refit()
        record["k3_bf16"] = MismatchProbe(trainer_view, bf16.engine).probe(ids, mask).metrics.k3_kl  # type: ignore[arg-type]
    return record


def _trainer(module: torch.nn.Module) -> TrainerModel:
    return module.trainer()  # type: ignore[operator]


class _ModuleScorer:
    """The trainer's log-probs as the training forward computes them (fake-quantized under QAT)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def log_probs(self, input_ids: torch.Tensor, *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        return self.module.log_probs(input_ids, temperature=temperature)  # type: ignore[operator]


def _nll(engine: Any, ids: torch.Tensor, mask: torch.Tensor) -> float:
    logp, _ = engine.log_probs(ids)
    return float(-logp[mask].mean())
