"""A ShardedTrainerModel over a Megatron-Core GPTModel: one rank of its tensor, pipeline and
expert parallel layout, refit without ever gathering the model.

Each rank names its own shards with the full model's Hugging Face names (`adapters.megatron.
hf_names`: layers by their global `layer_number`, experts by their MoE layer's
`local_expert_indices`), in the Hugging Face layout (its query groups' q/k/v rows, its [gate; up]
rows, its share of a GatedDeltaNet's q, k, v, z, b and a), and says for each what the refit
needs to place and quantize it (`LocalShard`: the full shape, the split dimension, its position
in its tensor-parallel group, the fused group). The full model's tensor list, the same on every
rank, comes from one exchange over Megatron's pipeline group when the adapter is built: every
stage's list, with each rank's experts expanded to all of them.

Build it on every trainer rank at the same time:

    layout = megatron_layout()                       # from megatron.core.parallel_state
    trainer = MegatronShardedModel.build(model, layout, torch.distributed.get_rank())

The layout is Megatron's default rank order (`tp-cp-ep-dp-pp`) with cp = 1 and no virtual
pipeline stages, layers split evenly over the stages (`domain.refit.topology`, `domain.refit.shard_map`); `check` compares
what the rank holds with where the refit places every tensor and names any difference.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from adapters.megatron.fused_forward import unwrap_model
from adapters.megatron.hf_names import hf_parts, hf_tensors
from domain.errors import MegatronModelUnsupported, ShardingError
from domain.quant import naming
from domain.refit.shard_map import Placement
from domain.refit.topology import ParallelLayout

try:
    from megatron.core import parallel_state
except ImportError as err:  # pragma: no cover - exercised only without megatron-core
    raise ModuleNotFoundError(
        "adapters.megatron.sharded_model needs megatron-core (the `megatron` extra)", name="megatron.core"
    ) from err

_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<index>\d+)\.(?P<rest>.+)$")
Shapes = list[tuple[str, tuple[int, ...]]]


def _size(name: str) -> int:
    getter = getattr(parallel_state, f"get_{name}_world_size", None)
    value = getter() if getter is not None else None
    return int(value) if value else 1


def _rank(name: str) -> int:
    getter = getattr(parallel_state, f"get_{name}_rank", None)
    value = getter() if getter is not None else None
    return int(value) if value else 0


def megatron_layout() -> ParallelLayout:
    """The ParallelLayout of the initialized `megatron.core.parallel_state`.

    Returns:
        tp, pp, ep, etp and the data-parallel size. Raises MegatronModelUnsupported for context
        parallelism and virtual pipeline stages (their rank grids are not the refit's), and
        ShardingError for an expert tensor-parallel size the refit cannot export (1 < etp != tp).
    """
    if not parallel_state.model_parallel_is_initialized():
        raise MegatronModelUnsupported("megatron.core.parallel_state is not initialized; call "
                                       "initialize_model_parallel before building the refit")
    if _size("context_parallel") > 1:
        raise MegatronModelUnsupported("context parallelism (cp > 1) is not supported by the sharded refit; "
                                       "its rank grid differs from tp-ep-dp-pp")
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp not in (None, 1):
        raise MegatronModelUnsupported(f"virtual pipeline stages ({vpp} per rank) are not supported by the "
                                       "sharded refit: a rank's layers are not one contiguous block")
    return ParallelLayout(
        tp=_size("tensor_model_parallel"), pp=_size("pipeline_model_parallel"), ep=_size("expert_model_parallel"),
        etp=_size("expert_tensor_parallel"), dp=_size("data_parallel"),
    )


@attrs.frozen
class LocalShard:
    """One tensor this rank holds, as the refit needs it.

    Attributes:
        name: the full model's Hugging Face name.
        shape: the full tensor's shape.
        shard_shape: the shape of this rank's piece.
        split_dim: the dimension tensor parallelism splits (Megatron's `partition_dim`), or None.
        index: this rank's position in the group that splits it (its TP or expert-TP rank).
        group_size: ranks in that group (1: held whole).
        group: the fused group it is quantized with (q/k/v, gate/up), or None.
    """

    name: str
    shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    split_dim: int | None
    index: int
    group_size: int
    group: str | None


def _is_expert(name: str) -> bool:
    return _EXPERT.match(naming.module_name(name)) is not None


def _expand_experts(entries: Sequence[tuple[str, tuple[int, ...]]], num_experts: int) -> Shapes:
    """A stage's (name, full shape) list with every MoE layer's experts: each rank lists its own
    experts; all of them have the names and shapes of the first one, with their index."""
    out: Shapes = []
    i = 0
    while i < len(entries):
        m = _EXPERT.match(entries[i][0])
        if m is None:
            out.append(entries[i])
            i += 1
            continue
        prefix = m["prefix"]
        run = []
        while i < len(entries) and (mm := _EXPERT.match(entries[i][0])) is not None and mm["prefix"] == prefix:
            run.append((int(mm["index"]), mm["rest"], entries[i][1]))
            i += 1
        first = run[0][0]
        template = [(rest, shape) for e, rest, shape in run if e == first]
        out += [(f"{prefix}.{e}.{rest}", shape) for e in range(num_experts) for rest, shape in template]
    return out


@attrs.define
class MegatronShardedModel:
    """A ShardedTrainerModel: rank `rank` of `layout`, over a built Megatron-Core GPTModel.

    Attributes:
        model: the model as built (Float16Module, DDP, ... allowed); its parameters are read as
            they are at every refit: through views where the Hugging Face layout is a slice of
            the parameter, else derived again from the parameter at each read (training updates
            parameters in place; nothing is copied between refits).
        layout: the trainer's parallel layout (`megatron_layout()`).
        rank: this trainer rank (its torch.distributed rank).
        dtype: the dtype the refit reads the shards in (the rollout's, e.g. bfloat16: float32
            master weights are cast on the fly, one tensor at a time); None = as stored.
    """

    model: torch.nn.Module
    layout: ParallelLayout
    rank: int
    dtype: torch.dtype | None = None
    _local: dict[str, torch.Tensor] = attrs.field(init=False, factory=dict)
    _derived: dict[str, tuple[str, torch.Tensor]] = attrs.field(init=False, factory=dict)
    _shards: dict[str, LocalShard] = attrs.field(init=False, factory=dict)
    _shapes: Shapes = attrs.field(init=False, factory=list)

    @classmethod
    def build(cls, model: torch.nn.Module, layout: ParallelLayout, rank: int, *,
              dtype: torch.dtype | None = None, gather: Any = None) -> MegatronShardedModel:
        """Name this rank's shards and learn the full model's tensor list (collective over the
        pipeline group: call it on every trainer rank).

        Args:
            model: the model as built.
            layout: the parallel layout; it must be parallel_state's.
            rank: this trainer rank.
            dtype: the dtype shards are read in (None: as stored).
            gather: `(stage list) -> every stage's list, by stage`; default an all-gather over
                Megatron's pipeline-parallel group.

        Returns:
            The adapter. Raises ShardingError when the layout or the rank is not parallel_state's,
            MegatronModelUnsupported for a parameter without a Hugging Face name.
        """
        self = cls(model, layout, rank, dtype)
        self._check_parallel_state()
        real = unwrap_model(model)[0]
        config: Any = real.config
        params = dict(real.named_parameters())
        state = real.state_dict(keep_vars=False)
        coords = layout.coords(rank)
        stage: list[tuple[str, tuple[int, ...]]] = []
        for hf, tensor, source in hf_tensors(real):
            if hf in self._local:
                raise ShardingError(hf, f"two Megatron tensors map to it (the second is {source!r})")
            param = params.get(source)
            expert = _is_expert(hf)
            n, index = (layout.etp, coords.etp_rank) if expert else (layout.tp, coords.tp_rank)
            dim = getattr(param, "partition_dim", None) if getattr(param, "tensor_model_parallel", False) else None
            if n == 1 or dim is None:
                dim, n, index = None, 1, 0
            full = list(tensor.shape)
            if dim is not None:
                full[dim] *= n
            shard = LocalShard(hf, tuple(full), tuple(tensor.shape), dim, index, n,
                               naming.classify(hf, tuple(full)).group)
            self._local[hf], self._shards[hf] = tensor, shard
            if not _aliases(tensor, state[source]):  # a new tensor (q/k/v of several groups, GDN's qkv)
                self._derived[hf] = (source, state[source])
            stage.append((hf, shard.shape))
        stage = _expand_experts(stage, int(getattr(config, "num_moe_experts", None) or 0))
        stages = gather(stage) if gather is not None else _gather_stages(stage, layout.pp)
        self._shapes = [entry for s in stages for entry in s]
        return self

    def _check_parallel_state(self) -> None:
        layout, c = self.layout, self.layout.coords(self.rank)
        mine = megatron_layout()
        if (mine.tp, mine.pp, mine.ep, mine.etp, mine.size) != (layout.tp, layout.pp, layout.ep, layout.etp, layout.size):
            raise ShardingError("actor.megatron", f"the refit's trainer layout is {layout.describe()} over {layout.size} "
                                f"ranks, Megatron's parallel_state is {mine.describe()} over {mine.size}; give the "
                                "refit Megatron's layout (megatron_layout())")
        seen = (_rank("pipeline_model_parallel"), _rank("tensor_model_parallel"), _rank("expert_model_parallel"),
                _rank("expert_tensor_parallel"))
        if seen != (c.stage, c.tp_rank, c.ep_rank, c.etp_rank):
            raise ShardingError("actor.megatron", f"rank {self.rank} is (stage, tp, ep, etp) = {seen} in Megatron's "
                                f"parallel_state but {(c.stage, c.tp_rank, c.ep_rank, c.etp_rank)} in the refit's layout; "
                                "initialize Megatron with the default rank order (tp-cp-ep-dp-pp) and its trainer "
                                "ranks first in the refit world")

    # --- ShardedTrainerModel -------------------------------------------------------------------

    def weight_shapes(self) -> Shapes:
        """Every tensor of the full model, as (Hugging Face name, full shape), stage by stage."""
        return list(self._shapes)

    def local_weight(self, name: str) -> torch.Tensor:
        """This rank's piece of `name`, in the Hugging Face layout and in `dtype`, as the
        parameter holds it now: a view of the parameter where the layout is one, else derived
        again from the parameter's current value (q/k/v of several query groups, a gated q_proj,
        GDN's joined q/k/v)."""
        t = self._local.get(name)
        if t is None:
            raise ShardingError(name, f"trainer rank {self.rank} holds no part of it")
        derived = self._derived.get(name)
        if derived is not None:
            source, live = derived
            live = live.detach()
            live = live if self.dtype is None or live.dtype == self.dtype else live.to(self.dtype)
            return dict(hf_parts(unwrap_model(self.model)[0], source, live))[name]
        t = t.detach()
        return t if self.dtype is None or t.dtype == self.dtype else t.to(self.dtype)

    # --- what the refit needs --------------------------------------------------------------------

    def shards(self) -> list[LocalShard]:
        """Every tensor this rank holds (data-parallel copies included), in state-dict order."""
        return list(self._shards.values())

    def check(self, placements: Mapping[str, Placement]) -> None:
        """Compare what this rank holds with the refit's placement of every tensor.

        A tensor placed on this rank must be the piece the placement says (split dimension,
        position, shape); one placed elsewhere must be a copy on a data-parallel replica of the
        same stage.

        Raises:
            ShardingError: naming the tensor and the difference (e.g. an uneven pipeline split).
        """
        stage = self.layout.coords(self.rank).stage
        for s in self._shards.values():
            p = placements.get(s.name)
            if p is None:
                raise ShardingError(s.name, "is not in the refit's tensor list; build every rank from the same model")
            if self.rank not in p.holders:
                if self.layout.coords(p.source).stage != stage:
                    raise ShardingError(s.name, f"rank {self.rank} (stage {stage}) holds it, the refit places it on stage "
                                        f"{self.layout.coords(p.source).stage}: layers must be split evenly over the "
                                        "pipeline stages (no uneven first/last stages, no custom layout)")
                continue
            want = (p.split_dim, len(p.holders), p.holders.index(self.rank), p.shard_shape(self.rank), p.shape)
            got = (s.split_dim, s.group_size, s.index, s.shard_shape, s.shape)
            if want != got:
                raise ShardingError(s.name, f"rank {self.rank} holds (split dim, group, position, shard, full) = {got}; "
                                    f"the refit expects {want}")


def _aliases(part: torch.Tensor, whole: torch.Tensor) -> bool:
    """Whether `part` is a view into `whole`'s storage (then it follows every in-place update)."""
    return part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()


def _gather_stages(stage: Shapes, pp: int) -> list[Shapes]:
    if pp == 1:
        return [stage]
    import torch.distributed as dist

    out: list[Any] = [None] * pp
    dist.all_gather_object(out, stage, group=parallel_state.get_pipeline_model_parallel_group())
    return out
