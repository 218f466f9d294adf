"""Port: what can be read from a serving engine besides its log-probs, to compare two engines."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from domain.lora.adapter import LoraAdapter


@runtime_checkable
class EngineInspection(Protocol):
    """An engine's weights and serving as a comparison reads them: a refitted engine against a cold
    start of the same export (`refit demo vllm`, `refit bench engine`, the real-engine
    tests). Runtime-checkable: a service holds a RolloutEngine and asks whether it can be
    inspected.
    """

    def digests(self) -> dict[str, str]:
        """sha256 of every parameter and buffer (dtype, shape and bytes; `domain.refit.storage.
        weight_digest`), by the engine's own name: equal digests are the same weights, bit for bit.
        A parameter the engine keeps packed outside its (emptied) tensor has the digest
        `UNREADABLE`, which equals nothing: compare with `DigestComparison`, which lists it.

        Returns:
            name -> hex digest (the first worker's, for an engine with several).
        """
        ...

    def kv_scales(self) -> dict[str, list[float]]:
        """Each attention layer's KV-cache scales [q, k, v, prob], by the layer's name (empty for an
        engine without them)."""
        ...

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy (temperature 0) continuations of token-id prompts, `max_tokens` each, each a
        function of the weights and its prompt alone (not of which other prompts shared a decode
        step: an engine that batches by arrival decodes them one at a time). An engine that
        refuses to serve (stale, mid-refit) raises as its `log_probs` does."""
        ...

    def close(self) -> None:
        """Shut the engine down and release what was made for it (idempotent where it can be)."""
        ...


@runtime_checkable
class AdapterTwins(Protocol):
    """An engine that serves LoRA adapters and loads one from a directory itself: the twin of an
    adapter rl-refit staged, written as PEFT writes it (`refit demo lora --engine vllm`, the
    real-engine tests). The served adapter and its twin must answer alike, bit for bit.
    """

    def disk_twin(self, adapter: LoraAdapter, directory: str, adapter_id: int) -> Any:
        """Write `adapter` into `directory` as PEFT writes it; returns the request naming it
        (`lora=` of `log_probs` and `greedy`), loaded by the engine's own loader."""
        ...

    def drop_twin(self, twin: Any) -> None:
        """Release what the engine holds for the twin."""
        ...

    def log_probs(self, input_ids: torch.Tensor, *, temperature: float = 1.0,
                  lora: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt log-probs with the served adapter, or with `lora`."""
        ...

    def greedy(self, prompts: list[list[int]], max_tokens: int, *, lora: Any = None) -> list[list[int]]:
        """Greedy continuations with the served adapter, or with `lora`."""
        ...
