"""The post-refit probe as a service step: after a refit committed, the engine's log-probs on a
small fixed batch against a reference (domain.refit.probe says which bound applies)."""

from __future__ import annotations

import operator
from typing import Any

import attrs
import torch

from app.config_sections import VerifyConfig
from domain.errors import ProbeMismatch
from domain.quant.plan import QuantizationPlan
from domain.refit.probe import probe_bound
from domain.refit.report import ProbeCheck
from ports.probe_reference import ProbeReference
from ports.rollout_engine import RolloutEngine
from ports.trainer_model import TrainerModel


def probe_batch(vocab_size: int, batch: int = 2, seq_len: int = 16, seed: int = 0) -> torch.Tensor:
    """A fixed token batch [batch, seq_len] (the same for every refit of a run)."""
    g = torch.Generator().manual_seed(0x9B0BE + seed)
    return torch.randint(0, vocab_size, (batch, seq_len), generator=g)


@attrs.frozen
class PostRefitProbe:
    """Compare the engine with a reference after each refit.

    Attributes:
        reference: the reference log-probs.
        input_ids: the probe batch [B, T].
        bound: the max abs log-prob difference allowed; None = the plan's (probe_bound).
    """

    reference: ProbeReference
    input_ids: torch.Tensor
    bound: float | None = None

    def measure(self, engine: RolloutEngine, plan: QuantizationPlan) -> ProbeCheck:
        """The engine's log-probs on the probe batch against the reference's."""
        bound = self.bound if self.bound is not None else probe_bound(plan, engine_way=self.reference.engine_way)
        served, _ = engine.log_probs(self.input_ids)
        return ProbeCheck.compare(served.float(), self.reference.log_probs(self.input_ids).float(),
                                  bound=bound, name=self.reference.name)


def require(check: ProbeCheck, refit_id: int) -> None:
    """ProbeMismatch unless the probe passed (the caller marks the engine stale)."""
    if not check.passed:
        raise ProbeMismatch(refit_id, check.max_abs_diff, check.bound, check.reference)


@attrs.frozen
class TrainerReference:
    """The trainer's own log-probs (its BF16 forward) as the probe's reference."""

    trainer: TrainerModel
    name: str = "the trainer's BF16 forward"
    engine_way: bool = False

    def log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.trainer.log_probs(input_ids)[0]


@attrs.frozen
class EngineReference:
    """Another engine's log-probs as the reference: one started cold from the exported checkpoint
    computes the refitted engine's way, so the probe allows no difference."""

    engine: RolloutEngine
    name: str = "a cold start of the exported checkpoint"
    engine_way: bool = True

    def log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.engine.log_probs(input_ids)[0]


@attrs.frozen
class ColdStartReference:
    """An engine started cold from the exported checkpoint (`Services.engines.cold_start`: its
    `log_probs(input_ids)` returns the [B, T-1] log-probs alone) as the reference: it computes the
    refitted engine's way, so the probe allows no difference."""

    cold: Any  # a cold start (an engine plugin's cold_start): log_probs(input_ids) -> Tensor
    name: str = "a cold start of the exported checkpoint"
    engine_way: bool = True

    def log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.cold.log_probs(input_ids)


def trainer_probe(trainer: TrainerModel, verify: VerifyConfig, plan: QuantizationPlan, *,
                  embedded_engine: bool) -> PostRefitProbe | None:
    """The post-refit probe of rollout.verify (None when off): the trainer's log-probs as the
    reference, the plan's bound unless max_abs_logp_diff is set.

    The embedded engine runs the trainer's own forward, so with a BF16 plan the trainer's
    log-probs are computed the engine's way and the bound is exactly 0; otherwise the plan's
    per-format bound (domain.refit.probe.TRAINER_BOUNDS).

    Args:
        trainer: the refit's trainer.
        verify: rollout.verify.
        plan: the configuration's plan.
        embedded_engine: the engine is the embedded reference engine (rollout.name reference).
    """
    if not verify.enabled:
        return None
    engine_way = embedded_engine and plan.linear.name == plan.moe.name == "BF16"
    vocab = int(operator.attrgetter("config.vocab_size")(trainer))  # the port has none; every trainer adapter does
    reference = TrainerReference(trainer, name="the trainer's forward (the engine's own)" if engine_way
                                 else "the trainer's BF16 forward", engine_way=engine_way)
    return PostRefitProbe(reference, probe_batch(vocab, verify.batch, verify.seq_len), bound=verify.max_abs_logp_diff)
