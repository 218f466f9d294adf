"""Which trainer rank holds and exports each tensor, and the math that keeps a sharded export
bit-identical to the single-process one.

A trainer of `tp x pp x ep` ranks (rank = (stage * ep + ep_rank) * tp + tp_rank):
- pipeline stages own contiguous layers (tensors before the first layer go to stage 0, those after
  the last layer to the last stage);
- expert-parallel ranks own whole routed experts (expert e on ep_rank e // (E / ep)); every other
  tensor belongs to ep_rank 0 of its stage;
- tensor parallelism splits column-parallel weights (q/k/v, dense gate/up, embeddings, LM head)
  along rows and row-parallel weights (o_proj, dense down_proj) along K; norms, routers and
  experts are not split.

The `source` of a tensor is tp_rank 0 of the (stage, ep_rank) that owns it: it packs the tensor
into buckets and sends them. A TP-split tensor is quantized on every TP rank when its shard
boundaries fall on block boundaries ("local"), the quantized pieces gathered and concatenated on
the source; otherwise the BF16 shards are gathered and the source quantizes ("gather"). Either way
an NVFP4 tensor or fused group gets its global scale from the maximum of the ranks' local amax (an
all-reduce), so the bytes equal the single-process export's. That math is in domain.refit.shard_quant.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import attrs

from domain.errors import ShardingError
from domain.quant import naming
from domain.quant.plan import QuantizationPlan, TensorDecision
from domain.quant.units import export_units

# How a TP-split tensor is exported: each holder quantizes its shard ("local"), or the BF16 shards
# are gathered on the source, which quantizes ("gather").
ShardMode = Literal["local", "gather"]


class Role(enum.StrEnum):
    """What a rank of a refit world does."""

    TRAINER = "trainer"
    ENGINE = "engine"


_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_ROW_PARALLEL = ("o_proj", "down_proj", "w2")
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")


def _ints(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


def _at_least_one(_inst: object, attr: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ShardingError(attr.name, f"must be >= 1, got {value}")


@attrs.frozen
class RankCoords:
    """A trainer rank's place in the layout: pipeline stage, expert-parallel rank, TP rank."""

    stage: int
    ep_rank: int
    tp_rank: int


@attrs.frozen
class ParallelLayout:
    """How the trainer is split: tensor (tp), pipeline (pp) and expert (ep) parallel sizes.

    Attributes:
        tp: tensor-parallel ranks per (stage, ep_rank).
        pp: pipeline stages.
        ep: expert-parallel ranks per stage.
    """

    tp: int = attrs.field(default=1, validator=_at_least_one)
    pp: int = attrs.field(default=1, validator=_at_least_one)
    ep: int = attrs.field(default=1, validator=_at_least_one)

    @property
    def size(self) -> int:
        """Trainer ranks."""
        return self.tp * self.pp * self.ep

    def coords(self, rank: int) -> RankCoords:
        """The (stage, ep_rank, tp_rank) of trainer `rank`."""
        if not 0 <= rank < self.size:
            raise ShardingError("rank", f"trainer rank {rank} is outside [0, {self.size})")
        return RankCoords(rank // (self.tp * self.ep), (rank // self.tp) % self.ep, rank % self.tp)

    def rank_of(self, stage: int, ep_rank: int, tp_rank: int = 0) -> int:
        """The trainer rank at (stage, ep_rank, tp_rank)."""
        return (stage * self.ep + ep_rank) * self.tp + tp_rank

    def tp_ranks(self, stage: int, ep_rank: int) -> tuple[int, ...]:
        """The TP group of (stage, ep_rank), its source (tp_rank 0) first."""
        return tuple(self.rank_of(stage, ep_rank, t) for t in range(self.tp))

    def describe(self) -> str:
        return f"tp={self.tp} pp={self.pp} ep={self.ep}"


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


@attrs.frozen
class Placement:
    """Where one full (Hugging Face) tensor lives in the trainer.

    Attributes:
        name: the tensor's name.
        shape: its full shape.
        split_dim: the TP-split dimension, or None when one rank holds it whole.
        holders: the ranks holding a piece of it, the source (tp_rank 0) first.
    """

    name: str
    shape: tuple[int, ...] = attrs.field(converter=_ints)
    split_dim: int | None
    holders: tuple[int, ...] = attrs.field(converter=_ints)

    @property
    def source(self) -> int:
        return self.holders[0]

    @property
    def is_split(self) -> bool:
        return len(self.holders) > 1

    def shard_slices(self, rank: int) -> tuple[slice, ...]:
        """The part of the full tensor that `rank` holds (every dimension)."""
        if rank not in self.holders:
            raise ShardingError(self.name, f"rank {rank} holds no part of it (holders {list(self.holders)})")
        slices = [slice(0, d) for d in self.shape]
        if self.split_dim is not None:
            step = self.shape[self.split_dim] // len(self.holders)
            i = self.holders.index(rank)
            slices[self.split_dim] = slice(i * step, (i + 1) * step)
        return tuple(slices)

    def shard_shape(self, rank: int) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.shard_slices(rank))


@attrs.frozen
class ExportUnit:
    """Tensors exported together: one tensor, or a fused NVFP4 group sharing one global scale.

    Attributes:
        members: the members' placements, in stream order (same holders).
        decisions: each member's quantization decision.
        modes: per member, "local" (each holder quantizes its shard; pieces are concatenated) or
            "gather" (BF16 shards are gathered and the source quantizes): a ShardMode.
        group: the fused group's name, or None.
    """

    members: tuple[Placement, ...]
    decisions: tuple[TensorDecision, ...]
    modes: tuple[ShardMode, ...]
    group: str | None = None

    @property
    def holders(self) -> tuple[int, ...]:
        return self.members[0].holders

    @property
    def source(self) -> int:
        return self.members[0].source

    @property
    def is_split(self) -> bool:
        return self.members[0].is_split

    @property
    def name(self) -> str:
        return self.group or self.members[0].name

    @property
    def has_global_scale(self) -> bool:
        """True when the members are NVFP4 (one global scale over the whole unit)."""
        return any(d.format.has_global_scale for d in self.decisions)


# --- placing a model ---------------------------------------------------------------------------


def _split_dim(name: str, shape: tuple[int, ...]) -> int | None:
    if len(shape) != 2 or _EXPERT.search(name) or not name.endswith(".weight"):
        return None
    if _VOCAB.search(name):
        return 0
    proj = naming.module_name(name).rsplit(".", 1)[-1]
    return 0 if proj in _COLUMN_PARALLEL else 1 if proj in _ROW_PARALLEL else None


def _aligned(decision: TensorDecision, p: Placement) -> bool:
    """Whether each TP shard covers whole blocks, so quantizing shards equals quantizing the whole."""
    fmt = decision.format
    if not decision.is_quantized or p.split_dim is None:
        return True
    extent = p.shape[p.split_dim] // len(p.holders)
    block = fmt.block_size[0] if p.split_dim == len(p.shape) - 2 else fmt.block_size[1]
    return extent % block == 0 and (not fmt.packed or p.split_dim != len(p.shape) - 1 or extent % 2 == 0)


@attrs.frozen
class ShardMap:
    """Every tensor's placement and the export units, for one layout and plan.

    Attributes:
        layout: the trainer's parallel layout.
        placements: name -> Placement, in stream (layer) order.
        units: the export units, in the order the single-process export emits them.
    """

    layout: ParallelLayout
    placements: dict[str, Placement]
    units: tuple[ExportUnit, ...]

    @classmethod
    def build(
        cls, layout: ParallelLayout, shapes: Sequence[tuple[str, tuple[int, ...]]], plan: QuantizationPlan
    ) -> ShardMap:
        """Place a model's tensors on the layout and group them into export units.

        Args:
            layout: tp / pp / ep sizes.
            shapes: (name, full shape) of every tensor, in layer order (the trainer's stream).
            plan: the rollout quantization plan (the same on every rank).

        Returns:
            The ShardMap. Raises ShardingError (a size that does not divide the model, naming the
            tensor and the configuration key) and NonDivisibleTensors (dispatch rule 9).
        """
        placements = place_tensors(layout, shapes)
        return cls(layout, placements, _units(plan, placements))

    def units_of(self, rank: int) -> tuple[ExportUnit, ...]:
        """The units `rank` takes part in (holds a piece of), in stream order."""
        return tuple(u for u in self.units if rank in u.holders)

    def segments(self) -> tuple[tuple[int, tuple[ExportUnit, ...]], ...]:
        """(source rank, its units) for every source with something to send, in rank order:
        stage by stage, so the engines receive the layers in order."""
        by_source: dict[int, list[ExportUnit]] = {}
        for u in self.units:
            by_source.setdefault(u.source, []).append(u)
        return tuple((s, tuple(by_source[s])) for s in sorted(by_source))

    def held_by(self, rank: int) -> tuple[Placement, ...]:
        """Placements of every tensor `rank` holds a piece of, in stream order."""
        return tuple(p for p in self.placements.values() if rank in p.holders)


def place_tensors(layout: ParallelLayout, shapes: Sequence[tuple[str, tuple[int, ...]]]) -> dict[str, Placement]:
    """Place every tensor of a model on the layout (see the module docstring for the rules).

    Args:
        layout: tp / pp / ep sizes.
        shapes: (name, full shape) of every tensor, in layer order.

    Returns:
        name -> Placement, in stream order. Raises ShardingError naming the tensor or the
        configuration key when a size does not divide the model.
    """
    layers = [naming.layer_index(n) for n, _ in shapes]
    known = [i for i in layers if i is not None]
    num_layers = max(known) + 1 if known else 1
    if layout.pp > num_layers:
        raise ShardingError(
            "actor.megatron.pipeline_model_parallel_size",
            f"pp={layout.pp} exceeds the model's {num_layers} layers; use at most {num_layers} stages",
        )
    experts = [int(m[1]) for n, _ in shapes if (m := _EXPERT.search(n))]
    num_experts = max(experts) + 1 if experts else 0
    if layout.ep > 1 and (num_experts == 0 or num_experts % layout.ep):
        raise ShardingError(
            "actor.megatron.expert_model_parallel_size",
            f"ep={layout.ep} does not divide the model's {num_experts} routed experts; use a divisor of it"
            if num_experts else f"ep={layout.ep} but the model has no routed (per-expert) weights; use ep=1",
        )
    first = layers.index(known[0]) if known else 0
    out: dict[str, Placement] = {}
    for pos, ((name, shape), layer) in enumerate(zip(shapes, layers, strict=True)):
        shape = tuple(shape)
        if name in out:
            raise ShardingError(name, "appears twice in the trainer's weights")
        if layer is not None:
            stage = layer * layout.pp // num_layers
        else:
            stage = 0 if not known or pos < first else layout.pp - 1
        m = _EXPERT.search(name)
        if layout.ep > 1 and naming.classify(name, shape).fused_experts:
            raise ShardingError(
                name, "a fused 3-D expert tensor cannot be split across expert-parallel ranks; "
                "export per-expert weights or use ep=1 (actor.megatron.expert_model_parallel_size)"
            )
        ep_rank = int(m[1]) // (num_experts // layout.ep) if m and layout.ep > 1 else 0
        dim = _split_dim(name, shape) if layout.tp > 1 else None
        if dim is not None and shape[dim] % layout.tp:
            raise ShardingError(
                "actor.megatron.tensor_model_parallel_size",
                f"tp={layout.tp} does not divide dimension {dim} ({shape[dim]}) of {name!r}; use a divisor of it",
            )
        ranks = layout.tp_ranks(stage, ep_rank)
        out[name] = Placement(name, shape, dim, ranks if dim is not None else ranks[:1])
    return out


def _units(plan: QuantizationPlan, placements: Mapping[str, Placement]) -> tuple[ExportUnit, ...]:
    """The export units (`domain.quant.units`), in the order the single-process export emits them."""
    units = []
    for unit in export_units(plan, ((p.name, p.shape, p) for p in placements.values())):
        if unit.group is not None and len({p.holders for p in unit.values}) > 1:
            raise ShardingError(unit.group, "members of a fused group live on different ranks; they must share a TP group")
        units.append(_unit([(p, d) for d, p in unit.items], unit.group))
    return tuple(units)


def _unit(items: Sequence[tuple[Placement, TensorDecision]], group: str | None) -> ExportUnit:
    modes: tuple[ShardMode, ...] = tuple("local" if _aligned(d, p) else "gather" for p, d in items)
    return ExportUnit(tuple(p for p, _ in items), tuple(d for _, d in items), modes, group)
