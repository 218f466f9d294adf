"""`refit demo lora --engine ENGINE`: the adapter mode into a real engine, each adapter against its
disk twin.

Step 0 sends the base and the adapter; every later step perturbs the adapter (the base stays
frozen) and sends it alone. After each step the adapter the engine serves is compared with its
disk twin: the same adapter written as PEFT writes it and loaded by the engine's own loader
(a load request of that directory), on the same base weights, in the same engine: prompt
log-probs and greedy tokens, bit for bit (docs/lora.md, on a real engine).
"""

from __future__ import annotations

import tempfile
from typing import Any

import attrs
import torch

from app.services.lora_sync import LoraSyncService
from domain.errors import ConfigError
from ports.engine_inspection import AdapterTwins

# Above rl-refit's own adapter ids (they count from 1), so that a twin never takes a served id.
TWIN_IDS = 1_000_000
GREEDY_TOKENS = 6


@attrs.frozen
class LoraEngineStep:
    """One adapter step and its comparison with the disk twin.

    Attributes:
        step: 0 = the first sync (base and adapter).
        live: whether the adapter went live.
        error: why not (empty when live).
        base_sent: whether the step sent the base too.
        bytes_sent: the bytes the step sent.
        adapter_bytes: the adapter's own bytes.
        logprobs_equal: the served adapter's prompt log-probs equal the twin's, bit for bit.
        tokens_equal: their greedy tokens are equal.
        max_abs_diff: the largest log-prob difference (0.0 when equal).
        moved: the served log-probs differ from the previous step's (step 0: True), so that the
            comparison saw the new adapter.
    """

    step: int
    live: bool
    error: str
    base_sent: bool
    bytes_sent: int
    adapter_bytes: int
    logprobs_equal: bool
    tokens_equal: bool
    max_abs_diff: float
    moved: bool = True

    @property
    def equal(self) -> bool:
        """Live, and equal to its twin, bit for bit."""
        return self.live and self.logprobs_equal and self.tokens_equal

    def to_dict(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "equals_disk_twin": self.equal}


def run_lora_engine_demo(svc: LoraSyncService, steps: int, seed: int = 0) -> list[LoraEngineStep]:
    """Sync the adapter `steps + 1` times (the first with the base) and compare each with its twin.

    Raises:
        ConfigError: the engine loads no adapter from a directory (it is not AdapterTwins).
    """
    engine, trainer = svc.engine, svc.trainer
    if not isinstance(engine, AdapterTwins):
        raise ConfigError("rollout.name", f"{type(engine).__name__} loads no LoRA adapter from a directory: the "
                          "LoRA demo on a real engine compares each adapter with the engine's own load of it")
    vocab = int(trainer.config.vocab_size)  # type: ignore[attr-defined]
    g = torch.Generator().manual_seed(seed + 11)
    ids = torch.randint(0, vocab, (2, 24), generator=g)
    prompts = [ids[0, :8].tolist(), ids[1, :8].tolist()]
    records: list[LoraEngineStep] = []
    previous: torch.Tensor | None = None
    with tempfile.TemporaryDirectory(prefix="rl-refit-lora-twins-") as root:
        for step in range(steps + 1):
            if step:
                trainer.perturb_(seed * 1000 + step, 0.05)  # type: ignore[attr-defined]
            report = svc.sync()
            twin = engine.disk_twin(trainer.adapter, f"{root}/{step}", TWIN_IDS + step)
            try:
                served, disk = engine.log_probs(ids)[0], engine.log_probs(ids, lora=twin)[0]
                tokens = engine.greedy(prompts, GREEDY_TOKENS)
                disk_tokens = engine.greedy(prompts, GREEDY_TOKENS, lora=twin)
            finally:
                engine.drop_twin(twin)  # a twin holds an adapter slot only while compared
            records.append(LoraEngineStep(
                step, report.live, report.error or "", report.base is not None, report.bytes_sent,
                report.adapter_bytes, bool(torch.equal(served, disk)), tokens == disk_tokens,
                float((served - disk).abs().max()), previous is None or not torch.equal(served, previous)))
            previous = served
    return records
