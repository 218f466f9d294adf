"""The configurations the demos and the benchmarks run with: the embedded models or a checkpoint
directory (`--model`), and a real engine's configuration for the engine demo's settings (what
`refit demo ENGINE`, `refit bench engine` and the real-engine tests start)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from adapters.plugins import plugin_for
from app.config_sections import (
    ActorConfig,
    CheckpointEngineConfig,
    EngineKwargsConfig,
    HfTrainerConfig,
    ModelConfig,
    QuantizationConfig,
    ReferenceConfig,
    RefitConfig,
    RolloutConfig,
)

if TYPE_CHECKING:
    from app.services.engine_demo import EngineDemoSettings

EMBEDDED_MODELS = ("tiny-moe", "tiny-dense", "micro-moe", "micro-dense")


def is_directory(model: str | None) -> bool:
    """`--model` names a checkpoint directory (options.model_or_directory made it absolute), not
    an embedded model."""
    return model is not None and model not in EMBEDDED_MODELS


def model_config(model: str, seed: int, base: RefitConfig | None = None) -> RefitConfig:
    """The configuration of the demo's model (on `base`): an embedded preset and its seed, or a
    checkpoint directory (model.path; the seed then only drives the steps and the batch)."""
    base = base or RefitConfig()
    if is_directory(model):
        return attrs.evolve(base, model=ModelConfig(path=model))
    return attrs.evolve(base, reference=ReferenceConfig(model=model, seed=seed))


def engine_config(settings: EngineDemoSettings, bucket_mb: float) -> RefitConfig:
    """The configuration of the demo's engine: the plan, the embedded model, the deployment, and
    engine arguments for a tiny model with no tokenizer (on a machine without CUDA, 1 GiB of
    KV cache in host memory)."""
    plan = settings.plan
    own = is_directory(settings.model)
    # your checkpoint: the transformers model is the trainer; the engine starts from its config.json
    # with dummy weights, as it does on the embedded model, so the first refit writes every weight
    actor = ActorConfig(strategy="hf", hf=HfTrainerConfig(load_model=True)) if own else ActorConfig()
    quantization = QuantizationConfig(
        linear=plan.linear.name if plan.linear.is_quantized else None,
        moe=plan.moe.name if plan.moe.is_quantized else None,
        moe_activation=None if plan.moe_activation is None else plan.moe_activation.value,
        linear_activation=None if plan.linear_activation is None else plan.linear_activation.value,
    )
    plugin = plugin_for(settings.engine)
    sections = {} if plugin.demo is None else {plugin.name: plugin.demo.section(settings.url, own)}
    rollout = RolloutConfig(
        name=settings.engine, deployment=settings.deployment, quantization=quantization,
        engine_kwargs=EngineKwargsConfig(**sections),
        checkpoint_engine=CheckpointEngineConfig(update_weights_bucket_megabytes=bucket_mb),
    )
    return model_config(settings.model, settings.seed, RefitConfig(rollout=rollout, actor=actor))


def with_engine_args(config: RefitConfig, *, start_timeout_s: float | None = None,
                     **engine_args: object) -> RefitConfig:
    """`config` with more engine arguments for rollout.name's engine (and another start timeout):
    its section's `engine_args` and `start_timeout_s`."""
    name = config.rollout.name
    section = config.rollout.engine_kwargs.engine(name)
    section = attrs.evolve(section, engine_args={**section.engine_args, **engine_args},
                           start_timeout_s=section.start_timeout_s if start_timeout_s is None else start_timeout_s)
    kwargs = attrs.evolve(config.rollout.engine_kwargs, **{name: section})
    return attrs.evolve(config, rollout=attrs.evolve(config.rollout, engine_kwargs=kwargs))
