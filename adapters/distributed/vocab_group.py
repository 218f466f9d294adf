"""The vocabulary-parallel group of the fused log-prob math, over a torch.distributed process group."""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.distributed as dist


@attrs.frozen
class TorchVocabGroup:
    """domain.forward.fused_logprob.VocabGroup over a process group (Megatron's TP group).

    Attributes:
        group: the process group whose ranks each hold one vocabulary shard.
    """

    group: Any

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def all_reduce_max(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
