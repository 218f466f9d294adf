"""Which trainer rank holds and exports each tensor, and the math that keeps a sharded export
bit-identical to the single-process one.

On a layout (domain.refit.topology), with the split rules of domain.refit.split_rules:
- pipeline stages own contiguous layers (tensors before the first layer go to stage 0, those after
  the last layer and the multi-token-prediction (MTP) layers to the last stage);
- expert-parallel ranks own whole routed experts (expert e on ep_rank e // (E / ep)); every other
  tensor belongs to the stage's tensor-parallel group (its first `tp` ranks: data-parallel
  replicas beyond it hold copies and export nothing);
- a tensor the split rules split is spread over its group, section by section where it has
  sections; every other tensor lives on the group's first rank.

The `source` of a tensor is the first holder of the group that owns it: it packs the tensor
into buckets and sends them. A TP-split tensor is quantized on every TP rank when its shard
boundaries fall on block boundaries ("local"), the quantized pieces gathered and concatenated on
the source; otherwise the BF16 shards are gathered and the source quantizes ("gather"). Either way
an NVFP4 tensor or fused group gets its global scale from the maximum of the ranks' local amax (an
all-reduce), so the bytes equal the single-process export's. That math is in domain.refit.shard_quant.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import attrs
import torch

from domain.errors import ShardingError
from domain.keys import key as config_key
from domain.quant import naming
from domain.quant.plan import QuantizationPlan, TensorDecision
from domain.quant.units import export_units
from domain.refit.split_rules import expert_index, gdn_sections, is_mtp, split_dimension
from domain.refit.topology import ParallelLayout

# How a TP-split tensor is exported: each holder quantizes its shard ("local"), or the BF16 shards
# are gathered on the source, which quantizes ("gather").
ShardMode = Literal["local", "gather"]


def _ints(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


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
            tensor and the configuration key) and NonDivisibleTensors (dispatch rule BlockDivisibility).
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
    """Place every tensor of a model on the layout (see the module docstrings of this module and of
    domain.refit.split_rules for the rules).

    Args:
        layout: tp / pp / ep / etp sizes.
        shapes: (name, full shape) of every tensor, in layer order.

    Returns:
        name -> Placement, in stream order. Raises ShardingError naming the tensor or the
        configuration key when a size does not divide the model.
    """
    by_name = {n: tuple(s) for n, s in shapes}
    mtp = [is_mtp(n) for n, _ in shapes]
    layers = [None if in_mtp else naming.layer_index(n) for (n, _), in_mtp in zip(shapes, mtp, strict=True)]
    known = [i for i in layers if i is not None]
    num_layers = max(known) + 1 if known else 1
    if layout.pp > num_layers:
        raise ShardingError(
            config_key("megatron", "pipeline_model_parallel_size"),
            f"pp={layout.pp} exceeds the model's {num_layers} layers; use at most {num_layers} stages",
        )
    experts = [e for n, _ in shapes if (e := expert_index(n)) is not None]
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
        expert = expert_index(name)
        if layout.ep > 1 and naming.classify(name, shape).fused_experts:
            raise ShardingError(
                name, "a fused 3-D expert tensor cannot be split across expert-parallel ranks; "
                f"export per-expert weights or use ep=1 ({config_key('megatron', 'expert_model_parallel_size')})"
            )
        if expert is not None:
            group = layout.expert_ranks(stage, expert // (num_experts // layout.ep) if layout.ep > 1 else 0)
            key, size = config_key("megatron", "expert_tensor_parallel_size"), f"etp={layout.etp}"
        else:
            group = layout.dense_ranks(stage)
            key, size = config_key("megatron", "tensor_model_parallel_size"), f"tp={layout.tp}"
        dim = split_dimension(name, shape) if len(group) > 1 else None
        sections = gdn_sections(name, shape, by_name) if dim is not None else ()
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
