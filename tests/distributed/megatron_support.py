"""Real Megatron-Core models in a world of gloo processes, captured once for the sharded-refit tests.

`capture_rank` runs in each process of a 4-process world: for every case it initializes Megatron's
parallel_state over the case's ranks (`local_world_size`), builds the model, and records what the
sharded trainer adapter gives (the full tensor list, every shard) together with Megatron's own
description of every local tensor (`sharded_state_dict`: global key, shape and offset, through
adapters.megatron.global_weights). In the test process, `reference_weights` rebuilds the global
tensors from that description alone, loads them into a tp = pp = ep = 1 model and exports it: the unsharded export of the same global weights, the
reference every sharded refit is compared with. `RecordedShards` replays a rank's captured shards
as a ShardedTrainerModel, so the refits themselves run densely in threads (adapters.memory).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from domain.refit.topology import ParallelLayout

MODELS = ("moe", "dense-tied", "hybrid")


@attrs.frozen
class Case:
    """One captured world: a model and Megatron parallel sizes (at most 4 ranks)."""

    model: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1

    @property
    def ranks(self) -> int:
        import math

        return self.pp * math.lcm(self.tp, self.ep * self.etp)

    @property
    def id(self) -> str:
        return f"{self.model}-tp{self.tp}-pp{self.pp}-ep{self.ep}" + (f"-etp{self.etp}" if self.etp > 1 else "")


def pack(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t.detach().contiguous().clone(), buf)
    return buf.getvalue()


def unpack(data: bytes) -> torch.Tensor:
    return torch.load(io.BytesIO(data))


def _config(model: str) -> Any:
    from adapters.reference.config import MICRO_MOE

    return attrs.evolve(MICRO_MOE, num_experts=0, moe_intermediate_size=0, mlp_only_layers=()) if model == "dense-tied" \
        else MICRO_MOE


def build_model(case: Case, seed: int = 0) -> torch.nn.Module:
    """This rank's model of `case` (inside megatron_on_cpu, parallel_state initialized)."""
    if case.model == "hybrid":
        from tests.megatron_cpu import tiny_hybrid_model

        return tiny_hybrid_model(case.tp, case.pp, case.ep, case.etp, seed=seed)
    from adapters.megatron.reference_gpt import build_reference_gpt

    layout = ParallelLayout(case.tp, case.pp, case.ep, case.etp)
    return build_reference_gpt(_config(case.model), layout, seed=seed, tied=case.model == "dense-tied").eval()


def capture_rank(rank: int, cases: Sequence[Case]) -> list[dict[str, Any]]:
    """Every case's shards on this rank (an empty record where the case has fewer ranks)."""
    from megatron.core import parallel_state

    from adapters.megatron.cpu import megatron_on_cpu
    from adapters.megatron.global_weights import megatron_pieces
    from adapters.megatron.sharded_model import MegatronShardedModel, megatron_layout
    from domain.refit.shard_map import place_tensors

    out = []
    with megatron_on_cpu(), torch.compiler.set_stance("force_eager"):
        for case in cases:
            parallel_state.initialize_model_parallel(
                case.tp, case.pp, expert_model_parallel_size=case.ep, expert_tensor_parallel_size=case.etp,
                local_world_size=case.ranks,
            )
            record: dict[str, Any] = {}
            if rank < case.ranks:
                layout = megatron_layout()
                model = build_model(case)
                trainer = MegatronShardedModel.build(model, layout, rank, dtype=torch.bfloat16)
                shapes = trainer.weight_shapes()
                trainer.check(place_tensors(layout, shapes))  # raises on any difference
                record = {
                    "layout": attrs.asdict(layout), "shapes": shapes,
                    "shards": {s.name: pack(trainer.local_weight(s.name)) for s in trainer.shards()},
                    "declared": [attrs.asdict(s) for s in trainer.shards()],
                    "pieces": megatron_pieces(model),
                    "refused": _refusals(model, trainer, layout, rank),
                }
                record["after_update"] = _after_update(model, trainer)
            parallel_state.destroy_model_parallel()
            out.append(record)
    return out


def _after_update(model: torch.nn.Module, trainer: Any) -> dict[str, list[str]]:
    """Update every parameter in place (as an optimizer step does), then compare what the adapter
    reads with a fresh Hugging Face export of the model: `stale` names tensors the adapter still
    reads as they were, `unchanged` those whose value did not move (the update must reach all)."""
    from adapters.megatron.hf_names import hf_tensors

    before = {s.name: trainer.local_weight(s.name).clone() for s in trainer.shards()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.linspace(0.5, 1.5, p.numel()).reshape(p.shape))
    fresh = {hf: t for hf, t, _ in hf_tensors(model)}
    now = {n: trainer.local_weight(n) for n in before}
    return {
        "stale": [n for n, t in now.items() if not torch.equal(t, fresh[n].to(t.dtype))],
        "unchanged": [n for n, t in now.items() if torch.equal(t, before[n])],
    }


def _refusals(model: torch.nn.Module, trainer: Any, layout: ParallelLayout, rank: int) -> dict[str, str]:
    """What the adapter says when the refit's view differs from Megatron's: a layout that is not
    parallel_state's, a layer the refit places on another stage, a shard split another way."""
    from adapters.megatron.sharded_model import MegatronShardedModel
    from domain.refit.shard_map import place_tensors

    out = {}
    try:
        MegatronShardedModel.build(model, attrs.evolve(layout, pp=layout.pp * 2), rank)
    except Exception as err:
        out["layout"] = f"{type(err).__name__}: {err}"
    placements = place_tensors(layout, trainer.weight_shapes())
    mine = next(s for s in trainer.shards() if s.name.startswith("model.layers.") and ".experts." not in s.name)
    other = [p for p in placements.values() if rank not in p.holders and p.name.startswith("model.layers.")
             and layout.coords(p.source).stage != layout.coords(rank).stage]
    if other:  # pretend the refit put this rank's tensor on another stage (an uneven pipeline split)
        moved = dict(placements)
        moved[mine.name] = attrs.evolve(placements[mine.name], holders=other[0].holders, split_dim=None)
        try:
            trainer.check(moved)
        except Exception as err:
            out["stage"] = f"{type(err).__name__}: {err}"
    split = next((p for p in placements.values() if p.is_split and rank in p.holders), None)
    if split is not None:
        flipped = dict(placements)
        flipped[split.name] = attrs.evolve(split, holders=tuple(reversed(split.holders)))
        try:
            trainer.check(flipped)
        except Exception as err:
            out["position"] = f"{type(err).__name__}: {err}"
    return out


def reference_weights(case: Case, records: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The tp = pp = ep = 1 export (HF name -> BF16 tensor) of the global weights the case's ranks
    hold, rebuilt from Megatron's sharded_state_dict alone (call inside megatron_cpu())."""
    from adapters.megatron.global_weights import load_global
    from adapters.megatron.hf_names import hf_named_weights

    model = build_model(Case(case.model), seed=1234)  # other values: only the load can make them equal
    load_global(model, [p for r in records for p in r["pieces"]])
    return {n: t.detach().to(torch.bfloat16).clone() for n, t in hf_named_weights(model)}


@attrs.define
class RecordedShards:
    """A ShardedTrainerModel replaying one rank's captured shards."""

    shapes: list[tuple[str, tuple[int, ...]]]
    shards: dict[str, torch.Tensor]

    def weight_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(n, tuple(s)) for n, s in self.shapes]

    def local_weight(self, name: str) -> torch.Tensor:
        return self.shards[name]


def layout_of(record: dict[str, Any]) -> ParallelLayout:
    return ParallelLayout(**record["layout"])
