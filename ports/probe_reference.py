"""ProbeReference: what the post-refit probe compares the engine's log-probs with."""

from __future__ import annotations

from typing import Protocol

import torch


class ProbeReference(Protocol):
    """log p(token_t | tokens_<t) on the probe batch, as the refitted engine should serve them.

    Attributes:
        name: what the reference is, in words (e.g. "a cold start of the exported checkpoint").
        engine_way: the reference is computed the way the engine computes (the same engine
            started cold from the exported checkpoint, or an engine whose forward is the
            trainer's): the probe then allows no difference at all.
    """

    @property
    def name(self) -> str: ...

    @property
    def engine_way(self) -> bool: ...

    def log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T-1] float32 log-probs of `input_ids` [B, T] at temperature 1."""
        ...
