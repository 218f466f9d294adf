"""Port: what can be read from a serving engine besides its log-probs, to compare two engines."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class EngineInspection(Protocol):
    """An engine's weights and serving as a comparison reads them: a refitted engine against a cold
    start of the same export (`refit demo --engine vllm`, `refit bench engine`, the real-engine
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
