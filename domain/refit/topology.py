"""The trainer's parallel layout and the ranks of a refit world.

A trainer is laid out as Megatron-Core lays out one model replica (its default rank order,
`tp-cp-ep-dp-pp`, with cp = 1): pipeline stages are the outermost blocks of `R = lcm(tp, ep * etp)`
ranks each; inside a stage, local rank j is tensor-parallel rank `j % tp` of the dense layers and,
for the routed experts, expert-tensor-parallel rank `j % etp` of expert-parallel rank
`(j // etp) % ep`. Expert parallelism is carved out of the stage's ranks, as Megatron carves it out
of data parallelism: with tp = 2, ep = 2, etp = 1 one stage is 2 ranks, each a TP shard of the
dense layers and the owner of half the experts.

A refit world puts the engine ranks after the trainer ranks. Which tensor splits how is in
domain.refit.split_rules; where each tensor lives and how it is exported, in domain.refit.shard_map.
"""

from __future__ import annotations

import math

import attrs

from domain.errors import ShardingError
from domain.keys import key as config_key
from domain.refit.status import Role


def _at_least_one(_inst: object, attr: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ShardingError(attr.name, f"must be >= 1, got {value}")


@attrs.frozen
class RankCoords:
    """A trainer rank's place in the layout.

    Attributes:
        stage: its pipeline stage.
        ep_rank: its expert-parallel rank (the experts it owns).
        tp_rank: its tensor-parallel rank in the dense layers.
        etp_rank: its expert-tensor-parallel rank (its share of each expert it owns).
        dp_rank: its data-parallel replica of the dense layers inside the stage (0 exports).
    """

    stage: int
    ep_rank: int
    tp_rank: int
    etp_rank: int = 0
    dp_rank: int = 0


@attrs.frozen
class ParallelLayout:
    """How the trainer is split: Megatron-Core's tensor (tp), pipeline (pp), expert (ep) and expert
    tensor (etp) parallel sizes, over one model replica.

    Attributes:
        tp: tensor-parallel ranks of the dense layers (`tensor_model_parallel_size`).
        pp: pipeline stages (`pipeline_model_parallel_size`).
        ep: expert-parallel ranks per stage (`expert_model_parallel_size`).
        etp: tensor-parallel ranks of each expert (`expert_tensor_parallel_size`): 1, or tp.
        dp: data-parallel replicas of the dense layers (Megatron's data-parallel size); None =
            the fewest that hold every expert, lcm(tp, ep * etp) / tp. Ranks of further replicas
            hold copies: they take part in every agreement and export nothing.
    """

    tp: int = attrs.field(default=1, validator=_at_least_one)
    pp: int = attrs.field(default=1, validator=_at_least_one)
    ep: int = attrs.field(default=1, validator=_at_least_one)
    etp: int = attrs.field(default=1, validator=_at_least_one)
    dp: int | None = attrs.field(default=None)

    def __attrs_post_init__(self) -> None:
        if self.tp > 1 and self.etp > 1 and self.etp != self.tp:
            raise ShardingError(
                config_key("megatron", "expert_tensor_parallel_size"),
                f"etp={self.etp} with tp={self.tp}: a source would export dense and expert shards over two "
                "different groups; use etp=1 or etp=tp",
            )
        if self.dp is not None and (self.dp < 1 or (self.tp * self.dp) % (self.ep * self.etp)):
            raise ShardingError(
                "data_parallel_size",
                f"dp={self.dp}: tp * dp ({self.tp * self.dp}) must be a multiple of ep * etp ({self.ep * self.etp}), "
                "as Megatron-Core requires",
            )

    @property
    def per_stage(self) -> int:
        """Ranks of one pipeline stage: tp * dp (by default the fewest that hold every dense shard
        and every expert)."""
        return self.tp * self.dp if self.dp is not None else math.lcm(self.tp, self.ep * self.etp)

    @property
    def size(self) -> int:
        """Trainer ranks."""
        return self.pp * self.per_stage

    def coords(self, rank: int) -> RankCoords:
        """The coordinates of trainer `rank`."""
        if not 0 <= rank < self.size:
            raise ShardingError("rank", f"trainer rank {rank} is outside [0, {self.size})")
        j = rank % self.per_stage
        return RankCoords(rank // self.per_stage, (j // self.etp) % self.ep, j % self.tp, j % self.etp, j // self.tp)

    def dense_ranks(self, stage: int) -> tuple[int, ...]:
        """The tensor-parallel group that holds (and exports) the dense layers of `stage`."""
        return tuple(stage * self.per_stage + t for t in range(self.tp))

    def expert_ranks(self, stage: int, ep_rank: int) -> tuple[int, ...]:
        """The expert-tensor-parallel group that holds the experts of `ep_rank` in `stage`."""
        first = stage * self.per_stage + ep_rank * self.etp
        return tuple(first + t for t in range(self.etp))

    def tp_ranks(self, stage: int, ep_rank: int) -> tuple[int, ...]:
        """The ranks taking part in the segment of (stage, ep_rank), its source first: the dense
        group together with the expert group of ep_rank 0 (both start at the stage's first rank),
        the expert group alone for the other ep_ranks."""
        if ep_rank == 0:
            first = stage * self.per_stage
            return tuple(first + t for t in range(max(self.tp, self.etp)))
        return self.expert_ranks(stage, ep_rank)

    def rank_of(self, stage: int, ep_rank: int, tp_rank: int = 0) -> int:
        """The `tp_rank`-th rank of the segment of (stage, ep_rank) (0: its source)."""
        return self.tp_ranks(stage, ep_rank)[tp_rank]

    def describe(self) -> str:
        text = f"tp={self.tp} pp={self.pp} ep={self.ep}"
        text += f" etp={self.etp}" if self.etp > 1 else ""
        return text + (f" dp={self.dp}" if self.dp is not None and self.per_stage != math.lcm(self.tp, self.ep * self.etp) else "")


@attrs.frozen
class RefitWorld:
    """Every rank of a distributed refit: trainer ranks first, then engine ranks.

    Attributes:
        layout: the trainer's parallel layout (ranks 0 .. layout.size - 1).
        engines: engine ranks (layout.size ..), each a full replica that receives every bucket.
    """

    layout: ParallelLayout = attrs.field(factory=ParallelLayout)
    engines: int = attrs.field(default=1, validator=_at_least_one)

    @property
    def size(self) -> int:
        return self.layout.size + self.engines

    @property
    def trainer_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.layout.size))

    @property
    def engine_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.layout.size, self.size))

    def role(self, rank: int) -> Role:
        """`trainer` or `engine`. Raises ShardingError for a rank outside the world."""
        if not 0 <= rank < self.size:
            raise ShardingError("rank", f"rank {rank} is outside the refit world of {self.size} ranks")
        return Role.TRAINER if rank < self.layout.size else Role.ENGINE

    @classmethod
    def for_procs(cls, procs: int, moe: bool = True) -> RefitWorld:
        """The default world for `procs` processes (2..4): 2 = one trainer + one engine;
        3 = two trainer ranks (ep=2 for an MoE model, else tp=2) + one engine; 4 = two trainer
        ranks + two engine replicas.

        Args:
            procs: processes in the world.
            moe: whether the model has routed experts (ep) or not (tp).

        Returns:
            The RefitWorld.
        """
        if not 2 <= procs <= 4:
            raise ShardingError("--procs", f"must be 2, 3 or 4 on this machine, got {procs}")
        if procs == 2:
            return cls(ParallelLayout(), 1)
        two = ParallelLayout(ep=2) if moe else ParallelLayout(tp=2)
        return cls(two, procs - 2)
