"""Which trainer rank holds and exports each tensor, and the math that keeps a sharded export
bit-identical to the single-process one.

A trainer is laid out as Megatron-Core lays out one model replica (its default rank order,
`tp-cp-ep-dp-pp`, with cp = 1): pipeline stages are the outermost blocks of `R = lcm(tp, ep * etp)`
ranks each; inside a stage, local rank j is tensor-parallel rank `j % tp` of the dense layers and,
for the routed experts, expert-tensor-parallel rank `j % etp` of expert-parallel rank
`(j // etp) % ep`. Expert parallelism is carved out of the stage's ranks, as Megatron carves it out
of data parallelism: with tp = 2, ep = 2, etp = 1 one stage is 2 ranks, each a TP shard of the
dense layers and the owner of half the experts. Then:
- pipeline stages own contiguous layers (tensors before the first layer go to stage 0, those after
  the last layer and the multi-token-prediction (MTP) layers to the last stage);
- expert-parallel ranks own whole routed experts (expert e on ep_rank e // (E / ep)); every other
  tensor belongs to the stage's tensor-parallel group (its first `tp` ranks: data-parallel
  replicas beyond it hold copies and export nothing);
- tensor parallelism splits column-parallel weights (q/k/v, gate/up, embeddings, LM head, GDN
  input projections, the MTP input projection, and their biases) along rows, row-parallel
  weights (o_proj, down_proj, GDN out_proj) along K; GDN's conv1d, A_log and dt_bias follow their
  heads. The GDN q/k/v projection and conv1d are split section by section (each TP rank holds its
  share of q, of k and of v); expert tensor parallelism (etp > 1) splits each expert the same way;
  norms and routers are not split.

The `source` of a tensor is the first holder of the group that owns it: it packs the tensor
into buckets and sends them. A TP-split tensor is quantized on every TP rank when its shard
boundaries fall on block boundaries ("local"), the quantized pieces gathered and concatenated on
the source; otherwise the BF16 shards are gathered and the source quantizes ("gather"). Either way
an NVFP4 tensor or fused group gets its global scale from the maximum of the ranks' local amax (an
all-reduce), so the bytes equal the single-process export's. That math is in domain.refit.shard_quant.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import attrs
import torch

from domain.errors import ShardingError
from domain.keys import key as config_key
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
_ROW_PARALLEL = ("o_proj", "down_proj", "w2", "out_proj")
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3",
                    "in_proj_z", "in_proj_b", "in_proj_a")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")
_MTP = re.compile(r"^(?:model\.)?mtp\.")  # multi-token prediction layers (Qwen3.5 / DeepSeek-V3 naming)
_MTP_FC = re.compile(r"^(?:model\.)?mtp\.(?:layers\.\d+\.)?fc$")  # the MTP input projection [H, 2H]
_GDN_SECTIONED = ("linear_attn.in_proj_qkv", "linear_attn.conv1d")  # [q; k; v] along dim 0
_GDN_HEADS = ("linear_attn.A_log", "linear_attn.dt_bias")  # one value per value head


def _ints(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


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


@attrs.frozen
class Placement:
    """Where one full (Hugging Face) tensor lives in the trainer.

    Attributes:
        name: the tensor's name.
        shape: its full shape.
        split_dim: the TP-split dimension, or None when one rank holds it whole.
        holders: the ranks holding a piece of it, the source first, in shard order.
        sections: sizes along `split_dim` of consecutive blocks that are split separately (each
            holder holds its share of every block, e.g. GDN's [q; k; v]); () = one block.
    """

    name: str
    shape: tuple[int, ...] = attrs.field(converter=_ints)
    split_dim: int | None
    holders: tuple[int, ...] = attrs.field(converter=_ints)
    sections: tuple[int, ...] = attrs.field(default=(), converter=_ints)

    @property
    def source(self) -> int:
        return self.holders[0]

    @property
    def is_split(self) -> bool:
        return len(self.holders) > 1

    def _blocks(self) -> tuple[int, ...]:
        assert self.split_dim is not None
        return self.sections or (self.shape[self.split_dim],)

    def shard_parts(self, rank: int) -> tuple[tuple[slice, ...], ...]:
        """The parts of the full tensor that `rank` holds (every dimension), one per section, in
        the order the rank stores them (concatenated along `split_dim`)."""
        if rank not in self.holders:
            raise ShardingError(self.name, f"rank {rank} holds no part of it (holders {list(self.holders)})")
        whole = tuple(slice(0, d) for d in self.shape)
        if self.split_dim is None:
            return (whole,)
        i, n, parts, start = self.holders.index(rank), len(self.holders), [], 0
        for block in self._blocks():
            step = block // n
            part = list(whole)
            part[self.split_dim] = slice(start + i * step, start + (i + 1) * step)
            parts.append(tuple(part))
            start += block
        return tuple(parts)

    def shard_slices(self, rank: int) -> tuple[slice, ...]:
        """The part of the full tensor that `rank` holds, for a placement of one section."""
        parts = self.shard_parts(rank)
        if len(parts) != 1:
            raise ShardingError(self.name, "is split section by section; use shard_parts / shard_of")
        return parts[0]

    def shard_of(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """`rank`'s shard of the full tensor (a view when it is one section)."""
        parts = [full[p] for p in self.shard_parts(rank)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.split_dim or 0)

    def shard_shape(self, rank: int) -> tuple[int, ...]:
        parts = self.shard_parts(rank)
        shape = [s.stop - s.start for s in parts[0]]
        if self.split_dim is not None:
            shape[self.split_dim] = sum(p[self.split_dim].stop - p[self.split_dim].start for p in parts)
        return tuple(shape)


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


def split_dimension(name: str, shape: tuple[int, ...]) -> int | None:
    """The dimension tensor parallelism splits a (Hugging Face) tensor along (Megatron's
    `partition_dim`, vLLM's split), or None.

    Experts are judged like dense modules (their holders are the expert group); routers, norms,
    shared-expert gates and row-parallel biases are replicated.
    """
    module = naming.module_name(name)
    if _VOCAB.search(name):
        return 0
    if any(module.endswith(m) for m in (*_GDN_SECTIONED, *_GDN_HEADS)):
        return 0
    if _MTP_FC.match(module) and name.endswith(".weight") and len(shape) == 2:
        return 0
    proj = module.rsplit(".", 1)[-1]
    if name.endswith(".weight") and len(shape) == 2:
        return 0 if proj in _COLUMN_PARALLEL else 1 if proj in _ROW_PARALLEL else None
    if name.endswith(".bias") and len(shape) == 1 and proj in _COLUMN_PARALLEL:
        return 0  # a column-parallel layer's bias follows its rows; a row-parallel one is whole
    return None


def _gdn_sections(name: str, shape: tuple[int, ...], shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    """[key_dim, key_dim, value_dim] of a GDN q/k/v projection or conv1d, from its layer's
    in_proj_z (value_dim rows); () for every other tensor."""
    module = naming.module_name(name)
    for suffix in _GDN_SECTIONED:
        if module.endswith(suffix):
            z = shapes.get(module[: -len(suffix)] + "linear_attn.in_proj_z.weight")
            if z is None or (shape[0] - z[0]) % 2 or shape[0] <= z[0]:
                raise ShardingError(name, "a split GDN q/k/v tensor needs its layer's linear_attn.in_proj_z "
                                    "(value_dim rows) to find its q, k and v sections")
            key_dim = (shape[0] - z[0]) // 2
            return (key_dim, key_dim, z[0])
    return ()


def _aligned(decision: TensorDecision, p: Placement) -> bool:
    """Whether each TP shard covers whole blocks, so quantizing shards equals quantizing the whole.
    A placement split section by section is always gathered when quantized (its shards are not
    contiguous rows of the full tensor)."""
    fmt = decision.format
    if not decision.is_quantized or p.split_dim is None:
        return True
    if p.sections:
        return False
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
        layout: tp / pp / ep / etp sizes.
        shapes: (name, full shape) of every tensor, in layer order.

    Returns:
        name -> Placement, in stream order. Raises ShardingError naming the tensor or the
        configuration key when a size does not divide the model.
    """
    by_name = {n: tuple(s) for n, s in shapes}
    mtp = [bool(_MTP.match(n)) for n, _ in shapes]
    layers = [None if is_mtp else naming.layer_index(n) for (n, _), is_mtp in zip(shapes, mtp, strict=True)]
    known = [i for i in layers if i is not None]
    num_layers = max(known) + 1 if known else 1
    if layout.pp > num_layers:
        raise ShardingError(
            config_key("megatron", "pipeline_model_parallel_size"),
            f"pp={layout.pp} exceeds the model's {num_layers} layers; use at most {num_layers} stages",
        )
    experts = [int(m[1]) for n, _ in shapes if (m := _EXPERT.search(n))]
    num_experts = max(experts) + 1 if experts else 0
    if layout.ep > 1 and (num_experts == 0 or num_experts % layout.ep):
        raise ShardingError(
            config_key("megatron", "expert_model_parallel_size"),
            f"ep={layout.ep} does not divide the model's {num_experts} routed experts; use a divisor of it"
            if num_experts else f"ep={layout.ep} but the model has no routed (per-expert) weights; use ep=1",
        )
    first = layers.index(known[0]) if known else 0
    out: dict[str, Placement] = {}
    for pos, ((name, shape), layer) in enumerate(zip(shapes, layers, strict=True)):
        shape = tuple(shape)
        if name in out:
            raise ShardingError(name, "appears twice in the trainer's weights")
        if mtp[pos]:
            stage = layout.pp - 1  # Megatron builds the MTP block on the last stage
        elif layer is not None:
            stage = layer * layout.pp // num_layers
        else:
            stage = 0 if not known or pos < first else layout.pp - 1
        m = _EXPERT.search(name)
        if layout.ep > 1 and naming.classify(name, shape).fused_experts:
            raise ShardingError(
                name, "a fused 3-D expert tensor cannot be split across expert-parallel ranks; "
                f"export per-expert weights or use ep=1 ({config_key('megatron', 'expert_model_parallel_size')})"
            )
        if m is not None:
            group = layout.expert_ranks(stage, int(m[1]) // (num_experts // layout.ep) if layout.ep > 1 else 0)
            key, size = config_key("megatron", "expert_tensor_parallel_size"), f"etp={layout.etp}"
        else:
            group = layout.dense_ranks(stage)
            key, size = config_key("megatron", "tensor_model_parallel_size"), f"tp={layout.tp}"
        dim = split_dimension(name, shape) if len(group) > 1 else None
        sections = _gdn_sections(name, shape, by_name) if dim is not None else ()
        for extent in sections or ((shape[dim],) if dim is not None else ()):
            if extent % len(group):
                raise ShardingError(key, f"{size} does not divide dimension {dim} ({extent}) of {name!r}; use a divisor of it")
        out[name] = Placement(name, shape, dim, group if dim is not None else group[:1], sections)
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
