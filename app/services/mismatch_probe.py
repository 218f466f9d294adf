"""MismatchProbe: score one token batch with the trainer and with the rollout engine, compare."""

from __future__ import annotations

import attrs
import torch

from domain.mismatch import MismatchMetrics, mismatch_metrics
from ports.rollout_engine import RolloutEngine
from ports.trainer_model import TrainerModel


def token_batch(vocab_size: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """A reproducible batch of random token ids, int64 [batch, seq_len].

    Args:
        vocab_size: ids are drawn from [0, vocab_size).
        batch: sequences.
        seq_len: tokens per sequence (>= 2).
        seed: the random seed.

    Returns:
        The token ids.
    """
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq_len), generator=g)


def response_mask(batch: int, seq_len: int, prompt_len: int) -> torch.Tensor:
    """Mask over next-token positions [batch, seq_len - 1] that selects the response tokens.

    Position t scores token t + 1, so the response (tokens prompt_len..seq_len-1) is positions
    prompt_len - 1 .. seq_len - 2.

    Args:
        batch: sequences.
        seq_len: tokens per sequence.
        prompt_len: tokens of the prompt (>= 1, < seq_len).

    Returns:
        bool [batch, seq_len - 1].
    """
    if not 1 <= prompt_len < seq_len:
        raise ValueError(f"prompt_len must be in [1, {seq_len}), got {prompt_len}")
    mask = torch.zeros(batch, seq_len - 1, dtype=torch.bool)
    mask[:, prompt_len - 1 :] = True
    return mask


@attrs.frozen
class ProbeResult:
    """Mismatch metrics and the mean entropy on each side.

    Attributes:
        metrics: section-9 metrics over the response tokens.
        trainer_entropy: mean entropy of the trainer's next-token distributions (response tokens).
        rollout_entropy: the same for the rollout engine.
    """

    metrics: MismatchMetrics
    trainer_entropy: float
    rollout_entropy: float

    def to_dict(self) -> dict[str, object]:
        return {**self.metrics.to_dict(), "trainer_entropy": self.trainer_entropy, "rollout_entropy": self.rollout_entropy}


@attrs.define
class MismatchProbe:
    """Runs the trainer and the engine on the same tokens and reports the mismatch.

    Attributes:
        trainer: the trainer's model (the "old" log-probs).
        engine: the rollout engine (after a refit).
        temperature: sampling temperature both sides apply.
    """

    trainer: TrainerModel
    engine: RolloutEngine
    temperature: float = 1.0

    def probe(self, input_ids: torch.Tensor, mask: torch.Tensor | None = None) -> ProbeResult:
        """Score `input_ids` on both sides and compare on `mask`.

        Args:
            input_ids: int64 [B, T].
            mask: bool [B, T - 1] response mask; None = every position.

        Returns:
            The ProbeResult. Raises EngineStale / EngineBusy when the engine cannot serve.
        """
        old, old_ent = self.trainer.log_probs(input_ids, temperature=self.temperature)
        new, new_ent = self.engine.log_probs(input_ids, temperature=self.temperature)
        metrics = mismatch_metrics(old, new, mask)
        sel = mask.bool() if mask is not None else torch.ones_like(old, dtype=torch.bool)
        return ProbeResult(metrics, float(old_ent[sel].mean()), float(new_ent[sel].mean()))
