"""Any full TrainerModel presented as one rank of a tensor / pipeline / expert parallel layout.

Each rank keeps views of the full model's tensors and hands out the slices its placement gives it
(domain.refit.shard_map). It is what a trainer rank holds after a Megatron-style split, without a
Megatron: tests, `refit demo procs N`, and trainers that keep full weights on every rank.
The full trainer must update its tensors in place (as training does): the views follow them.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from domain.errors import ShardingError
from domain.refit.shard_map import Placement, place_tensors
from domain.refit.topology import ParallelLayout
from ports.trainer_model import TrainerModel


@attrs.define
class SlicedTrainer:
    """A ShardedTrainerModel: rank `rank` of `layout`, cut from a full trainer.

    Attributes:
        full: the full model.
        layout: the parallel layout.
        rank: this trainer rank.
    """

    full: TrainerModel
    layout: ParallelLayout
    rank: int
    _weights: dict[str, torch.Tensor] = attrs.field(init=False)
    _placements: dict[str, Placement] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.layout.coords(self.rank)  # validates the rank
        self._weights = dict(self.full.named_weights())
        self._placements = place_tensors(self.layout, self.weight_shapes())

    def weight_shapes(self) -> Sequence[tuple[str, tuple[int, ...]]]:
        """The full model's (name, shape), in layer order."""
        return [(n, tuple(t.shape)) for n, t in self._weights.items()]

    def local_weight(self, name: str) -> torch.Tensor:
        """This rank's slice of `name` (a view unless split section by section); ShardingError
        when the rank holds none of it."""
        p = self._placements.get(name)
        if p is None:
            raise ShardingError(name, "is not a tensor of this model")
        return p.shard_of(self._weights[name], self.rank)

    def held(self) -> list[str]:
        """Names of the tensors this rank holds a piece of, in layer order."""
        return [n for n, p in self._placements.items() if self.rank in p.holders]
