"""One rank's ports for a distributed refit: the model's tensor list, where every tensor goes,
the collectives, and an injected fault's wrapper (what the composition root hands the service)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from adapters.memory.faults import RankFault
from adapters.memory.faulty import RankPorts, wrap_rank
from domain.errors import ConfigError
from domain.quant.plan import QuantizationPlan
from domain.refit.shard_map import ShardMap
from domain.refit.topology import RefitWorld
from ports.refit_collectives import RefitCollectives
from ports.rollout_engine import RolloutEngine
from ports.sharded_trainer import ShardedTrainerModel

Shapes = Sequence[tuple[str, tuple[int, ...]]]


@attrs.frozen
class RankTimeouts:
    """The collectives' bounds and window (TorchDistCollectives)."""

    step_timeout_s: float = 60.0
    phase_timeout_s: float = 600.0
    window: int = 2


def wire_rank(world: RefitWorld, rank: int, plan: QuantizationPlan, *, trainer: ShardedTrainerModel | None,
              engine: RolloutEngine | None, own_model: bool, strategy: str, shapes: Shapes | None,
              default_shapes: Callable[[], Shapes], comm: RefitCollectives | None, bucket_bytes: int,
              timeouts: RankTimeouts, fault: RankFault | None = None,
              hang_s: float = 60.0) -> tuple[RankPorts, Shapes]:
    """This rank's ports and the model's (name, full shape) list.

    With a model of the caller's own (`own_model`), a trainer rank's shards give the tensor list
    and are checked against where the refit places every tensor; engine ranks learn the list
    from trainer rank 0 over torch.distributed (or take `shapes` with collectives of their own).
    Otherwise the list is `default_shapes()` (the embedded model's).

    Raises:
        ConfigError: an engine rank of a world with its own model and collectives but no
            `shapes`; a fault that does not fit this world (named `--fault-rank`).
    """
    if own_model and trainer is not None:
        shapes = trainer.weight_shapes()
    if own_model and comm is None:  # engine ranks learn the tensor list from trainer rank 0
        from adapters.distributed.objects import broadcast_object

        shapes = broadcast_object(shapes if rank == 0 else None, src=0)
    if shapes is None and own_model:
        raise ConfigError("distributed refit", f"rank {rank} is an engine rank of an actor.strategy="
                          f"{strategy} world with collectives of your own: pass shapes=")
    shapes = shapes if shapes is not None else default_shapes()
    shard_map = ShardMap.build(world.layout, shapes, plan)
    check = getattr(trainer, "check", None)
    if own_model and callable(check):
        check(shard_map.placements)  # what the rank holds = where the refit places it
    if comm is None:
        from adapters.distributed.collectives import TorchDistCollectives

        comm = TorchDistCollectives(world, rank, timeouts.step_timeout_s, timeouts.phase_timeout_s, bucket_bytes,
                                    timeouts.window)
    try:
        ports = wrap_rank(fault, RankPorts(comm, trainer, engine), world.role(rank), shard_map, hang_s)
    except ValueError as err:
        raise ConfigError("--fault-rank", str(err)) from None
    return ports, shapes
