"""Port: one rank of a sharded (tensor / pipeline / expert parallel) trainer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class ShardedTrainerModel(Protocol):
    """What a trainer rank offers a distributed refit: the full model's shapes, its own shards."""

    def weight_shapes(self) -> Sequence[tuple[str, tuple[int, ...]]]:
        """Every tensor of the full model, as (Hugging Face name, full shape), in layer order.

        Returns:
            The same list on every rank (the refit places tensors from it with domain.refit.shard_map).
        """
        ...

    def local_weight(self, name: str) -> torch.Tensor:
        """This rank's piece of tensor `name` (the whole tensor when it is not TP-split).

        Args:
            name: a name from `weight_shapes` that this rank holds (per its ShardMap placement).

        Returns:
            The shard, in the trainer's dtype; the refit checks its shape against the placement.
        """
        ...
