"""LoRA refits: the embedded trainer with an adapter (`actor.lora.rank`), and the adapter mode's
service (`actor.lora.sync: adapter`). The merged mode needs nothing here: its trainer's weights
are the merged model, refitted by `Services.refit_service` like any other."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from domain.errors import ConfigError

if TYPE_CHECKING:
    from app.config_sections import RefitConfig
    from app.services.lora_sync import LoraSyncService
    from app.services.refit import RefitService
    from domain.quant.plan import QuantizationPlan
    from ports.rollout_engine import RolloutEngine
    from ports.trainer_model import TrainerModel


def with_adapter(config: RefitConfig, trainer: TrainerModel) -> TrainerModel:
    """The embedded trainer with a seeded random adapter of `actor.lora.rank` (trainer unchanged
    when the rank is 0): a TrainerModel over the merged model, with `base` and `adapter` apart."""
    lora = config.actor.lora
    if lora.rank == 0:
        return trainer
    from adapters.reference.lora import LoraTrainer
    from adapters.reference.trainer import ReferenceTrainer

    if not isinstance(trainer, ReferenceTrainer):
        raise ConfigError("actor.lora.rank", "a random adapter is made for the embedded trainer only; a PEFT "
                          "model brings its own adapter (leave actor.lora.rank at 0)")
    return LoraTrainer.from_seed(trainer, r=lora.rank, lora_alpha=lora.alpha, seed=config.reference.seed)


@attrs.frozen
class LoraWiring:
    """`Services.lora`: the adapter mode's service.

    Attributes:
        config: the validated configuration.
        trainer_model: the configuration's trainer (`Services.trainer_model`).
        plan: the configuration's rollout plan.
        refit_service: makes the base's RefitService (`Services.refit_service`).
    """

    config: RefitConfig
    trainer_model: Callable[[], TrainerModel]
    plan: Callable[[], QuantizationPlan]
    refit_service: Callable[..., RefitService]

    def sync_service(self, *, plan: QuantizationPlan | None = None, trainer: TrainerModel | None = None,
                     engine: RolloutEngine | None = None, inject_fault: str | None = None,
                     fault_after: int = 0) -> LoraSyncService:
        """The adapter mode's LoraSyncService: the adapter each step, the base when it changed.

        Args:
            plan: the base's rollout plan (default: the configuration's; BF16 or quantized).
            trainer: a LoRA trainer (`base` and `adapter`; default: `trainer_model()`).
            engine: an engine that serves adapters (ports.lora_engine; default: a new one).
            inject_fault: a fault of the base refit (as `refit_service`'s).
            fault_after: base refits that succeed before it fires.

        Raises:
            ConfigError: actor.lora.sync is not adapter, the trainer has no adapter, or the engine
                serves none (naming the key).
        """
        from app.services.lora_sync import LoraSyncService, LoraTrainerModel
        from ports.lora_engine import LoraEngine

        if self.config.actor.lora.sync != "adapter":
            raise ConfigError("actor.lora.sync", "the adapter mode's service needs actor.lora.sync=adapter; with "
                              "merged, refit_service() sends the merged model")
        trainer = trainer or self.trainer_model()
        if not isinstance(trainer, LoraTrainerModel):
            raise ConfigError("actor.lora.rank", f"{type(trainer).__name__} has no LoRA adapter: set "
                              "actor.lora.rank (the embedded trainer) or pass a trainer with base and adapter")
        lora_trainer = trainer
        plan = plan or self.plan()
        base_refit = self.refit_service(plan=plan, trainer=lora_trainer.base, engine=engine,
                                            inject_fault=inject_fault, fault_after=fault_after)
        if not isinstance(base_refit.engine, LoraEngine):
            raise ConfigError("rollout.name", f"{type(base_refit.engine).__name__} serves no LoRA adapters; use "
                              "actor.lora.sync=merged (every engine), or an engine with adapter serving")
        return LoraSyncService(lora_trainer, base_refit.engine, base_refit)
