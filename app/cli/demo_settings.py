"""What `refit demo` and `refit demo procs` share: the settings from the command line, the
composition root's services for them, and how a world's typed errors are reported."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from app.bootstrap import Services, bootstrap
from app.config_sections import (
    ActorConfig,
    CheckpointEngineConfig,
    LoraConfig,
    RefitConfig,
    RolloutConfig,
)
from app.services.demo import DemoSettings
from app.services.demo_config import model_config
from app.services.refit import RefitService
from domain.errors import RankFailed
from domain.quant.plan import QuantizationPlan

if TYPE_CHECKING:  # the LoRA demo's service loads only when `--lora` runs, the engine demo's with a real engine
    from app.services.engine_demo import EngineDemoSettings
    from app.services.lora_sync import LoraSyncService


class RankOutcome(Protocol):
    """How one rank of a local world ended (`Services.world.launch_world` returns one per rank)."""

    @property
    def rank(self) -> int: ...
    @property
    def ok(self) -> bool: ...
    @property
    def error(self) -> str | None: ...
    @property
    def error_type(self) -> str | None: ...
    @property
    def typed(self) -> bool: ...


def _none(preset: str | None) -> str | None:
    return None if preset is None or preset.strip().upper() == "BF16" else preset


def settings_from_args(args: argparse.Namespace) -> DemoSettings:
    """DemoSettings from the command line; bad values raise ConfigError / ValueError naming them."""
    from domain.quant.plan import QuantizationPlan

    linear = "FP8_BLOCK" if args.linear is None else args.linear
    moe = "NVFP4" if args.moe is None else args.moe
    plan = QuantizationPlan.from_presets(linear=_none(linear), moe=_none(moe), moe_activation=args.moe_activation,
                                         linear_activation=args.linear_activation)
    return DemoSettings(
        plan=plan, model=args.model or "tiny-moe", seed=args.seed, steps=3 if args.steps is None else args.steps,
        commit_mode=args.commit_mode,
        bucket_megabytes=args.bucket_mb, inject_fault=args.inject_fault, fault_step=args.fault_step,
        presets=args.presets or bool(args.plot), lora_rank=getattr(args, "lora", None) or 0,
        lora_sync=getattr(args, "lora_sync", None) or "merged",
    )


# A real engine's world (`--engine vllm`): its rank starts the server before the first refit and
# reads what it serves after each one, while the trainer ranks wait in the next refit's first
# agreement: the bounds on every per-bucket wait and on every agreement.
REAL_ENGINE_STEP_TIMEOUT_S, REAL_ENGINE_PHASE_TIMEOUT_S = 120.0, 900.0


def real_engine_settings(args: argparse.Namespace, settings: DemoSettings) -> EngineDemoSettings | None:
    """The real engine a world's engine ranks refit (`refit demo procs|megatron --engine NAME`): its
    demo settings, with its plugin's defaults (preset, model, 2 steps) where the command line gives
    none; None for the embedded engine. ConfigError: `--commit-mode`, which is the embedded engine's."""
    if args.engine == "reference":
        return None
    from app.bootstrap import demo_of
    from app.services.engine_demo import EngineDemoSettings
    from domain.errors import ConfigError

    if settings.commit_mode != "transactional":
        raise ConfigError("--commit-mode", f"is the embedded engine's: a {args.engine} engine commits as it loads "
                          "and restores its copy of the previous weights when a refit fails; drop --commit-mode")
    demo = demo_of(args.engine)
    plan = QuantizationPlan.from_presets(
        linear=_none(demo.preset if args.linear is None else args.linear),
        moe=_none(demo.preset if args.moe is None else args.moe),
        moe_activation=args.moe_activation, linear_activation=args.linear_activation)
    return EngineDemoSettings(engine=args.engine, plan=plan, model=args.model or demo.model, seed=settings.seed,
                              steps=2 if args.steps is None else args.steps, back=False,
                              inject_fault=settings.inject_fault, fault_step=settings.fault_step,
                              step_scale=settings.step_scale)


def starting_servers(engine: str, engines: int) -> str:
    """The line a world's demo on a real engine prints before its ranks start (stderr): its engine
    ranks start their servers first, then every refit waits on them, and the cold starts come last."""
    ranks = "its engine rank starts" if engines == 1 else f"its {engines} engine ranks each start"
    return (f"starting the world: {ranks} a {engine} server first (about a minute on CPU); the cold starts to "
            "compare with come after the world has finished ...\n")


def demo_config(settings: DemoSettings) -> RefitConfig:
    """The configuration of the demo's embedded model, buckets and commit mode."""
    rollout = RolloutConfig(commit_mode=settings.commit_mode, checkpoint_engine=CheckpointEngineConfig(
        update_weights_bucket_megabytes=settings.bucket_megabytes))
    actor = ActorConfig(lora=LoraConfig(rank=settings.lora_rank, sync=settings.lora_sync))
    return model_config(settings.model, settings.seed, RefitConfig(rollout=rollout, actor=actor))


def demo_services(settings: DemoSettings) -> Services:
    """The composition root's services for the demo's embedded model, buckets and commit mode."""
    return bootstrap(demo_config(settings))


def arm_factory(settings: DemoSettings) -> Callable[[QuantizationPlan, object | None, str | None], RefitService]:
    """Each arm's refit service, through the composition root (the first arm builds the trainer)."""
    services = demo_services(settings)

    def build(plan: QuantizationPlan, trainer: object | None, fault: str | None) -> RefitService:
        return services.refit_service(plan=plan, trainer=trainer, inject_fault=fault,  # type: ignore[arg-type]
                                      fault_after=settings.fault_step)

    return build


def lora_arm_factory(settings: DemoSettings) -> Callable[[QuantizationPlan, object | None, str | None], LoraSyncService]:
    """Each arm's adapter-mode service, through the composition root (the first arm builds the
    trainer with its adapter)."""
    services = demo_services(settings)

    def build(plan: QuantizationPlan, trainer: object | None, fault: str | None) -> LoraSyncService:
        # base refits happen at step 0 and at the fault's step (run_lora_demo): the fault hits the latter
        return services.lora.sync_service(plan=plan, trainer=trainer, inject_fault=fault,  # type: ignore[arg-type]
                                          fault_after=min(settings.fault_step, 1))

    return build


# Typed errors a rank raises because another rank failed first: never the cause to report.
_CONSEQUENCES = ("PeerLost", "CollectiveTimeout", "PeerFailed", "TransportAborted", "DistributedRefitFailed")


def raise_typed_failure(results: Sequence[RankOutcome]) -> None:
    """Raise RankFailed (exit status 2, one line) when a rank of a world stopped on a typed error:
    the first rank whose error is its own (not a peer's loss), else the first typed one.

    Args:
        results: the world's outcomes, one per rank.

    Returns:
        None when no rank stopped on a typed error (the caller reports other failures).
    """
    typed = [r for r in results if not r.ok and r.typed]
    if not typed:
        return
    cause = next((r for r in typed if r.error_type not in _CONSEQUENCES), typed[0])
    raise RankFailed(f"rank {cause.rank}: {cause.error}")
