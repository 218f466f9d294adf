"""The composition root's sharded refits: the world from actor.megatron.*_parallel_size, and
the typed errors of a rank that lacks what its role needs (no processes, in-memory collectives)."""

from __future__ import annotations

import pytest

from adapters.memory.collectives import InMemoryWorld
from app.bootstrap import bootstrap
from app.composition.tables import TRAINERS
from domain.errors import ConfigError, ShardingError
from domain.refit.topology import ParallelLayout, RefitWorld


def test_the_world_follows_the_configured_parallel_sizes() -> None:
    assert bootstrap().world.refit_world() == RefitWorld(ParallelLayout(), 1)
    services = bootstrap({"actor": {"megatron": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                                                 "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1}}})
    world = services.world.refit_world(engines=2)
    assert world.layout == ParallelLayout(tp=2, pp=2, ep=2, etp=1) and world.size == 6 and world.engine_ranks == (4, 5)
    # Megatron's default expert tensor parallelism is the tensor-parallel size.
    default = bootstrap(overrides=["actor.megatron.tensor_model_parallel_size=2", "actor.megatron.expert_model_parallel_size=2"])
    assert default.world.refit_world().layout.etp == 2 and default.world.refit_world().layout.size == 4
    wide = bootstrap(overrides=["actor.megatron.tensor_model_parallel_size=2"]).world.refit_world(trainer_ranks=8)
    assert wide.layout.dp == 4 and wide.layout.size == 8
    with pytest.raises(ConfigError, match="trainer_ranks: 3 trainer ranks are not a multiple of tp"):
        bootstrap(overrides=["actor.megatron.tensor_model_parallel_size=2"]).world.refit_world(trainer_ranks=3)
    with pytest.raises(ShardingError, match="expert_tensor_parallel_size"):
        bootstrap(overrides=["actor.megatron.tensor_model_parallel_size=4", "actor.megatron.expert_tensor_parallel_size=2"]
                  ).world.refit_world()
    with pytest.raises(ConfigError, match="tensor_model_parallel_size: must be positive"):
        bootstrap(overrides=["actor.megatron.tensor_model_parallel_size=0"])


def _comm(world: RefitWorld, rank: int):
    return InMemoryWorld(world).collectives(rank)


def test_a_model_of_ones_own_needs_a_sharded_trainer_adapter() -> None:
    world = RefitWorld(ParallelLayout(tp=2), 1)
    with pytest.raises(ConfigError, match=r"actor.strategy: .reference. has no sharded trainer adapter"):
        bootstrap().world.distributed_refit(world, 0, comm=_comm(world, 0), model=object())
    assert TRAINERS["megatron"].sharded is not None and TRAINERS["reference"].sharded is None


def test_megatron_ranks_name_what_they_lack() -> None:
    pytest.importorskip("megatron.core", reason="needs megatron-core (the `megatron` extra)")
    world = RefitWorld(ParallelLayout(tp=2), 1)
    services = bootstrap(overrides=["actor.strategy=megatron"])
    with pytest.raises(ConfigError, match=r"megatron: pass this rank's model, distributed_refit\(world, rank, model=...\)"):
        services.world.distributed_refit(world, 1, comm=_comm(world, 1))
    with pytest.raises(ConfigError, match=r"engine rank of an actor\.strategy=megatron world with collectives of your own"):
        services.world.distributed_refit(world, 2, comm=_comm(world, 2))
