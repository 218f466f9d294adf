"""The adapter tables: which adapter builds the engine of `rollout.name` and the trainer of
`actor.strategy`, and what each needs installed.

Each entry imports its adapter only when it is built; a missing package raises
ModuleNotFoundError naming the adapter and the extra to install. Every builder configures the
engine for the plan it is given (`Services.rollout_engine(plan)`), never the configuration's own.
Builders take a BuildContext, the configuration and the few things the composition root builds
from it, never the root's Services.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from domain.errors import ConfigError
from domain.quant.support import MODELOPT_NVFP4

if TYPE_CHECKING:
    from adapters.engine_start import EngineStart
    from adapters.hf_checkpoint.reader import HfCheckpoint
    from adapters.reference.config import ReferenceModelConfig
    from adapters.vllm.factory import VllmHost
    from app.config_sections import RefitConfig
    from app.services.planning import PlanReport
    from domain.forward.mode import FusedForwardMode
    from domain.quant.backend_policy import BackendDecision
    from domain.quant.plan import QuantizationPlan
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
        remote: the engine can run in processes of its own (`rollout.deployment: disaggregated`),
            where its package is needed there, not here.
        sharded: trainers only: the factory of one rank's ShardedTrainerModel, called with the
            rank's model, the parallel layout and the rank (None: no sharded form).
    """

    adapter: str
    build: Callable[..., Any]
    package: str | None = None
    extra: str | None = None
    remote: bool = False
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
        vllm_host: what starting a vLLM engine needs from this process.
        fused_forward_mode: the fused-forward mode asked for (a Megatron trainer's).
    """

    config: RefitConfig
    checkpoint: Callable[[], HfCheckpoint | None]
    reference_config: Callable[[], ReferenceModelConfig]
    engine_start: Callable[[str, QuantizationPlan | None], EngineStart]
    vllm_host: Callable[[], VllmHost]
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
        from adapters.compressed_tensors.quantization_config import engine_quantization_config
        from adapters.reference.config import hf_weight_shapes
        from app.services.planning import bf16_linear_modules

        shapes = hf_weight_shapes(reference_config())
        engine_config = engine_quantization_config(report.resolution, bf16_linear_modules(report.plan, shapes))
    return EngineStart(report.plan, engine_config, report.resolution.layout, backends(report.plan), model_path)


def _reference_engine(ctx: BuildContext, plan: QuantizationPlan, **options: Any) -> RolloutEngine:
    from adapters.reference.factory import build_reference_engine

    return build_reference_engine(ctx.reference_config(), plan,
                                  commit_mode=options.get("commit_mode"),
                                  kv_cache_scheme=options.get("kv_cache_scheme"),
                                  device=ctx.config.reference.device)


def _vllm_engine(ctx: BuildContext, plan: QuantizationPlan, **options: Any) -> RolloutEngine:
    from adapters.vllm.factory import build_vllm_engine

    lora = ctx.config.actor.lora
    section = ctx.config.rollout.engine_kwargs.vllm
    if ctx.config.rollout.deployment == "attached":
        from adapters.vllm.factory import attach_vllm_engine

        urls = section.urls or ((section.url,) if section.url else ())
        if not urls:
            raise ConfigError("rollout.engine_kwargs.vllm.url", "rollout.deployment=attached refits a server you "
                              "started: give its URL (http://HOST:PORT), or urls for several replicas")
        return attach_vllm_engine(section, ctx.engine_start("vllm", plan), ctx.vllm_host(),
                                  urls[int(options.get("replica", 0))])
    return build_vllm_engine(ctx.config.rollout.engine_kwargs.vllm, ctx.engine_start("vllm", plan),
                             ctx.vllm_host(), deployment=ctx.config.rollout.deployment,
                             commit_mode=options.get("commit_mode"),
                             lora_rank=lora.rank if lora.sync == "adapter" else None)


def _sglang_engine(ctx: BuildContext, plan: QuantizationPlan, **options: Any) -> RolloutEngine:
    from adapters.sglang.factory import build_sglang_engine

    rollout = ctx.config.rollout
    if rollout.deployment == "disaggregated":
        raise ConfigError("rollout.deployment", "sglang runs colocated only (sglang.Engine in this process), or "
                          "attached to a server you started (rollout.deployment=attached)")
    if rollout.deployment == "attached":
        from adapters.sglang.factory import attach_sglang_engine

        if rollout.replicas > 1:
            raise ConfigError("rollout.replicas", "an attached SGLang deployment refits one server "
                              "(rollout.engine_kwargs.sglang.url): set rollout.replicas=1")
        if not rollout.engine_kwargs.sglang.url:
            raise ConfigError("rollout.engine_kwargs.sglang.url", "rollout.deployment=attached refits a server you "
                              "started: give its URL (http://HOST:PORT)")
        return attach_sglang_engine(rollout.engine_kwargs.sglang, ctx.engine_start("sglang", plan),
                                    sync_backend=rollout.checkpoint_engine.backend, wire_format=rollout.wire_format,
                                    commit_mode=options.get("commit_mode"))
    return build_sglang_engine(rollout.engine_kwargs.sglang, ctx.engine_start("sglang", plan),
                               sync_backend=rollout.checkpoint_engine.backend, wire_format=rollout.wire_format,
                               commit_mode=options.get("commit_mode"))


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


# rollout.name -> the engine adapter; actor.strategy -> the trainer adapter.
ENGINES: dict[str, AdapterEntry] = {
    "reference": AdapterEntry("adapters.reference.engine.ReferenceEngine", _reference_engine),
    "vllm": AdapterEntry("adapters.vllm.engine.VllmRolloutEngine", _vllm_engine, "vllm", "vllm", remote=True),
    # remote: attached to the user's server (sglang is needed there, not here); never disaggregated
    "sglang": AdapterEntry("adapters.sglang.engine.SglangRolloutEngine", _sglang_engine, "sglang", "sglang",
                           remote=True),
}
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
