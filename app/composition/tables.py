"""The adapter tables: which adapter builds the trainer of `actor.strategy` and the QAT backend of
a name, and what each needs installed (the engines of `rollout.name` are plugins,
adapters.plugins.PLUGINS); and the EngineRequest the composition root gives an engine plugin.

Each entry imports its adapter only when it is built; a missing package raises
ModuleNotFoundError naming the adapter and the extra to install. Engines are configured for the
plan they are given (`Services.rollout_engine(plan)`), never the configuration's own. Builders
take a BuildContext, the configuration and the few things the composition root builds from it,
never the root's Services.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from domain.errors import ConfigError
from domain.quant.support import MODELOPT_NVFP4

if TYPE_CHECKING:
    from adapters.engine_plugin import EngineHost, EnginePlugin, EngineRequest
    from adapters.engine_start import EngineStart
    from adapters.hf_checkpoint.reader import HfCheckpoint
    from adapters.reference.config import ReferenceModelConfig
    from app.config_sections import RefitConfig
    from app.services.planning import PlanReport
    from domain.forward.mode import FusedForwardMode
    from domain.quant.backend_policy import BackendDecision
    from domain.quant.plan import QuantizationPlan
    from domain.refit.session import CommitMode
    from domain.refit.topology import ParallelLayout
    from ports.qat_backend import QatBackend
    from ports.rollout_engine import RolloutEngine
    from ports.sharded_trainer import ShardedTrainerModel
    from ports.trainer_model import TrainerModel


@attrs.frozen
class AdapterEntry:
    """One row of an adapter table: how to build it and what it needs installed.

    Attributes:
        adapter: the adapter's name, for errors.
        build: the factory, called with the BuildContext and the build's options.
        package: the import name of the optional package it needs (None: nothing optional).
        extra: the rl-refit extra that installs that package.
        sharded: trainers only: the factory of one rank's ShardedTrainerModel, called with the
            rank's model, the parallel layout and the rank (None: no sharded form).
    """

    adapter: str
    build: Callable[..., Any]
    package: str | None = None
    extra: str | None = None
    sharded: Callable[..., ShardedTrainerModel] | None = None

    def require(self, key: str, name: str) -> None:
        """Raise ModuleNotFoundError naming the adapter and the extra when its package is missing."""
        if self.package is None:
            return
        try:
            found = importlib.util.find_spec(self.package) is not None
        except ModuleNotFoundError:  # a missing parent package
            found = False
        if not found:
            raise ModuleNotFoundError(
                f"{key}={name}: {self.adapter} needs {self.package}, which is not installed; "
                f"install it with pip install 'rl-refit[{self.extra}]'", name=self.package,
            )


@attrs.frozen
class BuildContext:
    """What the adapter builders take from the composition root: the configuration and the few
    things it builds from it, as callables (each is built only when a builder asks for it).

    Attributes:
        config: the validated configuration.
        checkpoint: model.path's checkpoint (None without one).
        reference_config: the embedded reference model's shapes.
        engine_start: what a real engine (by name) starts with for a plan (None: the configuration's).
        engine_host: what this process offers the engines it builds.
        fused_forward_mode: the fused-forward mode asked for (a Megatron trainer's).
    """

    config: RefitConfig
    checkpoint: Callable[[], HfCheckpoint | None]
    reference_config: Callable[[], ReferenceModelConfig]
    engine_start: Callable[[str, QuantizationPlan | None], EngineStart]
    engine_host: Callable[[], EngineHost]
    fused_forward_mode: Callable[[], FusedForwardMode]


def engine_start(report: PlanReport, reference_config: Callable[[], ReferenceModelConfig],
                 backends: Callable[[QuantizationPlan], BackendDecision], model_path: str | None) -> EngineStart:
    """What a real engine starts with: its quantization_config and layout for the plan of
    `report`, the backend decision, the model.

    Args:
        report: the plan's report (`Services.plan_report`), for the plan the engine serves.
        reference_config: the embedded model's shapes (asked only for a ModelOpt layout without
            a checkpoint).
        backends: the kernel backends for a plan (`Services.engines.backend_decision` of the engine).
        model_path: model.path (None: the embedded model).
    """
    from adapters.engine_start import EngineStart

    engine_config = report.engine_config
    if not report.shapes and report.resolution.layout == MODELOPT_NVFP4:
        # ModelOpt's config excludes modules by name (no `re:` entries): without a checkpoint the
        # engine serves the embedded model, whose names are known.
        from adapters.engine_quantization import engine_quantization_config
        from adapters.reference.config import hf_weight_shapes
        from app.services.planning import bf16_linear_modules

        shapes = hf_weight_shapes(reference_config())
        engine_config = engine_quantization_config(report.resolution, bf16_linear_modules(report.plan, shapes))
    return EngineStart(report.plan, engine_config, report.resolution.layout, backends(report.plan), model_path)


def engine_request(ctx: BuildContext, plugin: EnginePlugin, plan: QuantizationPlan, *, replica: int = 0,
                   commit_mode: CommitMode | None = None,
                   kv_cache_scheme: Mapping[str, object] | None = None) -> EngineRequest:
    """What the plugin of rollout.name builds one engine (replica `replica`) from."""
    from adapters.engine_plugin import EngineRequest

    rollout, lora = ctx.config.rollout, ctx.config.actor.lora
    return EngineRequest(rollout.engine_kwargs.engine(plugin.name), plan,
                         lambda: ctx.engine_start(plugin.name, plan), ctx.engine_host(), rollout.deployment, replica,
                         commit_mode, kv_cache_scheme, rollout.checkpoint_engine.backend, rollout.wire_format,
                         lora.rank if lora.sync == "adapter" else None)


def _reference_trainer(ctx: BuildContext, model: object | None) -> TrainerModel:
    """The embedded reference model: random weights of reference.model from reference.seed, or,
    with model.path, a Qwen3 / Qwen3-MoE checkpoint's weights at its shapes."""
    from adapters.reference.config import preset
    from adapters.reference.trainer import ReferenceTrainer
    from app.composition.lora import with_adapter

    ref = ctx.config.reference
    checkpoint = ctx.checkpoint()
    if checkpoint is not None:  # the reference model at the checkpoint's shapes, holding its weights
        from adapters.reference.hf_config import ties_head

        trainer = ReferenceTrainer.from_hf_weights(ctx.reference_config(), checkpoint.iter_tensors(),
                                                   tied=ties_head(checkpoint.config))
    else:
        trainer = ReferenceTrainer.from_seed(preset(ref.model), ref.seed)
    return with_adapter(ctx.config, trainer)


def _megatron_trainer(ctx: BuildContext, model: object | None) -> TrainerModel:
    from adapters.megatron.factory import megatron_trainer

    if model is None:
        raise ConfigError("actor.strategy", "megatron: pass the built Megatron model, bootstrap(config, model=...)")
    return megatron_trainer(model, ctx.fused_forward_mode(), gdn_kernels=ctx.config.actor.megatron.gdn_kernels)


def _hf_trainer(ctx: BuildContext, model: object | None) -> TrainerModel:
    """A live transformers model (`model=`), else model.path streamed from its files."""
    from adapters.hf.module import HfModuleTrainer

    if model is not None:
        from adapters.hf.lora import PeftTrainer, is_peft_model

        return PeftTrainer(model) if is_peft_model(model) else HfModuleTrainer(model)
    path = ctx.config.model.path
    if not path:
        raise ConfigError("actor.strategy", "hf: set model.path to a Hugging Face checkpoint directory, or pass "
                          "the transformers model, bootstrap(config, model=...)")
    if ctx.config.actor.hf.load_model:  # in memory and trainable (what the demo's steps perturb)
        from adapters.hf_checkpoint.config_checks import check_checkpoint_config

        check_checkpoint_config(ctx.checkpoint())  # type: ignore[arg-type]  # before transformers builds it
        return HfModuleTrainer.from_pretrained(path)
    from adapters.hf.checkpoint import HfCheckpointTrainer

    return HfCheckpointTrainer.open(path)


def _megatron_sharded(model: object, layout: ParallelLayout, rank: int) -> ShardedTrainerModel:
    from adapters.megatron.factory import megatron_sharded

    return megatron_sharded(model, layout, rank)


# actor.strategy -> the trainer adapter (the engines are adapters.plugins.PLUGINS).
TRAINERS: dict[str, AdapterEntry] = {
    "reference": AdapterEntry("adapters.reference.trainer.ReferenceTrainer", _reference_trainer),
    "megatron": AdapterEntry("adapters.megatron.trainer_model.MegatronTrainerModel", _megatron_trainer,
                             "megatron.core", "megatron", sharded=_megatron_sharded),
    "hf": AdapterEntry("adapters.hf.module.HfModuleTrainer", _hf_trainer, "transformers", "hf"),
}


def _reference_qat(numerics: str, layout: str) -> QatBackend:
    from adapters.qat_reference.backend import ReferenceQatBackend

    return ReferenceQatBackend(layout=layout)


def _modelopt_qat(numerics: str, layout: str) -> QatBackend:
    from adapters.modelopt.backend import ModelOptQatBackend

    return ModelOptQatBackend(numerics=numerics, layout=layout)


# The QAT backends, by name (`Services.trainer_side.qat(backend=...)`), built with (numerics, layout).
QAT_BACKENDS: dict[str, AdapterEntry] = {
    "reference": AdapterEntry("adapters.qat_reference.backend.ReferenceQatBackend", _reference_qat),
    "modelopt": AdapterEntry("adapters.modelopt.backend.ModelOptQatBackend", _modelopt_qat, "modelopt", "modelopt"),
}


def qat_backend(backend: str, numerics: str, layout: str) -> QatBackend:
    """The QAT backend of that name, for the layout and (ModelOpt's) the numerics."""
    entry = QAT_BACKENDS.get(backend)
    if entry is None:
        raise ConfigError("qat backend", f"{backend!r} is not one of {', '.join(QAT_BACKENDS)}")
    entry.require("qat backend", backend)
    built: QatBackend = entry.build(numerics, layout)
    return built


def native_codecs() -> str | None:
    """Build and install the native codec kernels (adapters/native_codecs): None, or why they are
    not there (the refit then tries the compiled path; docs/refit.md#the-codec-path)."""
    from adapters.native_codecs.kernels import install

    return install()


def with_fault(engine: RolloutEngine, spelling: str, after: int = 0) -> RolloutEngine:
    """`engine` wrapped to fail once where `spelling` says (`--inject-fault`: `[hang:]bucket:K`,
    `begin`, `finalize`, `verify`, `storage`), after `after` refits that succeed (demos, tests)."""
    from adapters.memory.faults import FaultScript
    from adapters.memory.faulty import ScriptedFaultyEngine

    try:
        script = attrs.evolve(FaultScript.parse(spelling), after=after)
    except ValueError as err:
        raise ConfigError("--inject-fault", str(err)) from None
    return ScriptedFaultyEngine(engine, script)
