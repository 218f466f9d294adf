"""The distributed wiring: the refit world of the configuration, each rank's refit service, the
rank faults of the demos, and local worlds of processes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from app.composition.tables import TRAINERS
from domain.errors import ConfigError
from domain.quant.rules import LAYOUT_DELTA_BACKEND

if TYPE_CHECKING:
    from adapters.distributed.launch import RankResult
    from adapters.memory.faults import RankFault
    from app.config_sections import RefitConfig
    from app.services.distributed_refit import DistributedRefitService
    from app.services.verification import PostRefitProbe
    from domain.quant.plan import QuantizationPlan
    from domain.refit.topology import RefitWorld
    from ports.refit_collectives import RefitCollectives
    from ports.rollout_engine import RolloutEngine
    from ports.sharded_trainer import ShardedTrainerModel
    from ports.trainer_model import TrainerModel


@attrs.frozen
class WorldWiring:
    """`Services.world`: what every rank of a refit world builds from the same configuration.

    Attributes:
        config: the validated configuration.
        plan: the configuration's rollout plan.
        trainer: the trainer given to bootstrap, or the one built (None: none yet).
        rollout_engine: a new engine for a plan (`Services.rollout_engine`).
        post_refit_probe: the post-refit probe over a reference trainer (`Services.post_refit_probe`).
    """

    config: RefitConfig
    plan: Callable[[], QuantizationPlan]
    trainer: Callable[[], TrainerModel | None]
    rollout_engine: Callable[[QuantizationPlan], RolloutEngine]
    post_refit_probe: Callable[[TrainerModel], PostRefitProbe | None]

    def refit_world(self, engines: int = 1, *, trainer_ranks: int | None = None) -> RefitWorld:
        """The refit world of `actor.megatron.*_parallel_size`: the trainer's ranks first (one
        model replica, or `trainer_ranks` with more data-parallel replicas), then `engines`.

        Every rank builds the same world from the same configuration; a Megatron trainer rank's
        adapter checks it against Megatron's parallel_state.

        Raises:
            ShardingError: sizes that do not form a layout (naming the key).
        """
        from domain.refit.topology import ParallelLayout, RefitWorld

        m = self.config.actor.megatron
        tp = m.tensor_model_parallel_size
        etp = m.expert_tensor_parallel_size if m.expert_tensor_parallel_size is not None else tp
        layout = ParallelLayout(tp, m.pipeline_model_parallel_size, m.expert_model_parallel_size, etp)
        if trainer_ranks is not None and trainer_ranks != layout.size:
            per_replica = layout.tp * layout.pp
            if trainer_ranks % per_replica:
                raise ConfigError("trainer_ranks", f"{trainer_ranks} trainer ranks are not a multiple of tp * pp ({per_replica})")
            layout = attrs.evolve(layout, dp=trainer_ranks // per_replica)
        return RefitWorld(layout, engines)

    def distributed_refit(
        self,
        world: RefitWorld,
        rank: int,
        *,
        plan: QuantizationPlan | None = None,
        comm: RefitCollectives | None = None,
        window: int = 2,
        step_timeout_s: float = 60.0,
        phase_timeout_s: float = 600.0,
        fault: RankFault | None = None,
        restore: str | None = None,
        hang_s: float = 60.0,
        model: object | None = None,
        shapes: Sequence[tuple[str, tuple[int, ...]]] | None = None,
        engine: RolloutEngine | None = None,
        reference: TrainerModel | None = None,
    ) -> DistributedRefitService:
        """This rank's DistributedRefitService: the call every rank of a refit world makes.

        Every rank calls it, in the same order (the torch.distributed collectives create process
        groups). On the embedded reference model (`actor.strategy: reference`), trainer ranks
        build the reference model from `reference.seed` and keep their slices. With a trainer of
        your own (`actor.strategy: megatron`), each trainer rank passes its model: the rank's
        shards come from TRAINERS[actor.strategy]'s sharded adapter, checked against where the
        refit places every tensor, and the engine ranks learn the model's tensor list from trainer
        rank 0. Engine ranks build an engine from ENGINES[rollout.name] (or use `engine`).

        Args:
            world: the refit world (trainer layout, engine count), e.g. `refit_world(engines)`.
            rank: this process's rank.
            plan: the rollout plan (default: the configuration's).
            comm: the collectives (default: torch.distributed, in an initialized process group).
            window: buckets in flight (2 = double buffering, 1 = none).
            step_timeout_s: bound on every per-bucket and tensor-parallel wait.
            phase_timeout_s: bound on turns and agreements (they include other ranks' work).
            fault: a RankFault (`rank_fault`; tests, demos): the ports of the rank it hits are
                wrapped to fail there.
            restore: `replay`, `engine` or `stale` (default: `rollout.checkpoint_engine.restore`;
                null there: replay for transactional engines, stale for per-layer ones).
            hang_s: how long an injected hang sleeps.
            model: trainer ranks of `actor.strategy: megatron`: this rank's built model (wrappers
                allowed; its parameters are read in place at every refit).
            shapes: the model's (name, full shape) list, for engine ranks that do not receive it
                over torch.distributed (a `comm` of your own).
            engine: engine ranks: the engine to refit (default: a new one from ENGINES).
            reference: engine ranks, with `rollout.verify.enabled`: a full trainer model holding
                the weights each refit sends (in-process worlds, or ranks that replay the same
                training steps), whose forward is the post-refit probe's reference, as in a
                single-process refit.

        Returns:
            The DistributedRefitService.
        """
        from adapters.distributed.rank_wiring import RankTimeouts, wire_rank
        from app.services.distributed_refit import DistributedRefitService
        from domain.refit.status import Role

        config = self.config
        bucket_bytes = config.rollout.checkpoint_engine.bucket_bytes
        if config.rollout.checkpoint_engine.backend == LAYOUT_DELTA_BACKEND:
            raise ConfigError("rollout.checkpoint_engine.backend", "layout_delta runs on the single-process refit "
                              "(refit_service); the distributed refit sends every tensor: use 'naive'")

        plan = plan or self.plan()
        own_model = model is not None or config.actor.strategy != "reference"
        trainer: ShardedTrainerModel | None = None
        if world.role(rank) is Role.TRAINER:
            trainer = self._sharded_trainer(model, world, rank) if own_model else self._sliced_trainer(world, rank)
        else:
            engine = engine or self.rollout_engine(plan)
        ports, shapes = wire_rank(
            world, rank, plan, trainer=trainer, engine=engine, own_model=own_model,
            strategy=config.actor.strategy, shapes=shapes, default_shapes=self._preset_shapes, comm=comm,
            bucket_bytes=bucket_bytes, timeouts=RankTimeouts(step_timeout_s, phase_timeout_s, window),
            fault=fault, hang_s=hang_s,
        )
        probe = None
        if world.role(rank) is Role.ENGINE and config.rollout.verify.enabled:
            if reference is None:
                raise ConfigError("rollout.verify.enabled", f"rank {rank} is an engine rank: its post-refit probe "
                                  "needs the trainer's weights; pass distributed_refit(..., reference=<a full trainer "
                                  "model>), or set rollout.verify.enabled=false")
            probe = self.post_refit_probe(reference)
        return DistributedRefitService(
            world, ports.comm, plan, shapes, trainer=ports.trainer, engine=ports.engine,
            bucket_bytes=bucket_bytes, window=window,
            restore=restore or config.rollout.checkpoint_engine.restore, probe=probe,
        )

    def rank_fault(self, text: str, rank: int, refit: int) -> RankFault:
        """A RankFault from its spelling (`--inject-fault`); ConfigError names --inject-fault."""
        from adapters.memory.faults import RankFault

        try:
            return RankFault.parse(text, rank, refit=refit)
        except ValueError as err:
            raise ConfigError("--inject-fault", str(err)) from None

    def launch_world(self, fn: Callable[..., Any], size: int, args: Sequence[Any] = (), *,
                     timeout_s: float = 120.0, start_method: str = "fork") -> list[RankResult]:
        """Run `fn(rank, *args)` in `size` local processes joined over gloo on 127.0.0.1
        (adapters.distributed.launch); returns one RankResult per rank. `start_method`
        `forkserver` starts them from a clean process (fn and args then travel pickled): what a
        world of Megatron-Core ranks needs once this process has run Megatron itself."""
        from adapters.distributed.launch import launch_world

        return launch_world(fn, size, args, timeout_s=timeout_s, start_method=start_method)

    def _preset_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        from adapters.reference.config import hf_weight_shapes, preset

        return hf_weight_shapes(preset(self.config.reference.model))

    def _sliced_trainer(self, world: RefitWorld, rank: int) -> ShardedTrainerModel:
        """This trainer rank's slice of the embedded reference model (or of the trainer given)."""
        from adapters.distributed.sliced_trainer import SlicedTrainer
        from adapters.reference.config import preset
        from adapters.reference.trainer import ReferenceTrainer

        ref = self.config.reference
        full = self.trainer() or ReferenceTrainer.from_seed(preset(ref.model), ref.seed)
        return SlicedTrainer(full, world.layout, rank)

    def _sharded_trainer(self, model: object | None, world: RefitWorld, rank: int) -> ShardedTrainerModel:
        """This trainer rank's ShardedTrainerModel from TRAINERS[actor.strategy]."""
        name = self.config.actor.strategy
        entry = TRAINERS.get(name)
        if entry is None or entry.sharded is None:
            raise ConfigError("actor.strategy", f"{name!r} has no sharded trainer adapter; set actor.strategy: megatron "
                              "to refit a model of your own, or leave model unset to refit the embedded one")
        entry.require("actor.strategy", name)
        if model is None:
            raise ConfigError("actor.strategy", f"{name}: pass this rank's model, distributed_refit(world, rank, model=...)")
        return entry.sharded(model, world.layout, rank)
