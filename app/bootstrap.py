"""The composition root: the only module that reads the configuration and the environment, and
the only one that picks adapters.

`bootstrap(config, ...)` validates a verl-style configuration, reads the honoured environment
variables once, and returns `Services`: the application services, each built on first use with
the adapters the configuration names. Rollout engines come from the ENGINES table (keyed by
`rollout.name`) and trainers from the TRAINERS table (keyed by `actor.strategy`, verl's name for the trainer); each entry imports
its adapter only when it is built, and a missing package raises ModuleNotFoundError naming the
adapter and the extra to install. The CLI, the demos and the benchmarks call it; tests call it
with fakes (`trainer=`, `engine=`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from adapters.profiles import backend_decision, profile_for
from app.config import load_config
from app.config_sections import RefitConfig
from domain.errors import ConfigError
from domain.quant.plan import QuantizationPlan
from domain.quant.rules import LAYOUT_DELTA_BACKEND
from domain.refit.delta_sync import DeltaSender
from domain.refit.session import CommitMode

if TYPE_CHECKING:
    import torch

    from adapters.engine_start import EngineStart
    from adapters.hf_checkpoint.reader import HfCheckpoint
    from adapters.megatron.packed_gdn import PackedGdnReport
    from adapters.memory.faults import RankFault
    from adapters.vllm.factory import VllmHost
    from app.services.distributed_refit import DistributedRefitService
    from app.services.logprob import LogProbService
    from app.services.mismatch_probe import MismatchProbe
    from app.services.planning import PlanReport
    from app.services.qat_setup import QatSession
    from app.services.refit import Progress, RefitService
    from app.services.verification import PostRefitProbe
    from domain.forward.mode import FusedForwardRequest
    from domain.quant.backend_policy import BackendDecision
    from domain.refit.topology import ParallelLayout, RefitWorld
    from ports.engine_profile import EngineProfile
    from ports.environment_probe import EnvironmentProbe
    from ports.qat_backend import QatBackend
    from ports.refit_collectives import RefitCollectives
    from ports.rollout_engine import RolloutEngine
    from ports.sharded_trainer import ShardedTrainerModel
    from ports.trainer_model import TrainerModel

# The environment variables rl-refit honours (read once, here, and passed down as values).
ENV_VARS = ("VERL_FUSED_USE_OP_HOOK", "VERL_ROLLOUT_USE_DEEP_GEMM", "RL_REFIT_VLLM_PYTHON")
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def read_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The honoured environment variables that are set (default: this process's environment)."""
    env = os.environ if environ is None else environ
    return {name: env[name] for name in ENV_VARS if name in env}


# --- the adapter tables ------------------------------------------------------------------------


@attrs.frozen
class AdapterEntry:
    """One row of an adapter table: how to build it and what it needs installed.

    Attributes:
        adapter: the adapter's name, for errors.
        build: the factory, called with the Services and the build's options.
        package: the import name of the optional package it needs (None: nothing optional).
        extra: the rl-refit extra that installs that package.
        remote: the engine can run in processes of its own (`rollout.deployment: disaggregated`),
            where its package is needed there, not here.
        sharded: trainers only: the factory of one rank's ShardedTrainerModel, called with the
            Services, the rank's model, the parallel layout and the rank (None: no sharded form).
    """

    adapter: str
    build: Callable[..., Any]
    package: str | None = None
    extra: str | None = None
    remote: bool = False
    sharded: Callable[..., Any] | None = None

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


def _reference_engine(services: Services, plan: QuantizationPlan, **options: Any) -> RolloutEngine:
    from adapters.reference.factory import build_reference_engine

    return build_reference_engine(services.reference_config(), plan, commit_mode=options.get("commit_mode"),
                                  kv_cache_scheme=options.get("kv_cache_scheme"))


def _engine_start(services: Services, engine: str, plan: QuantizationPlan | None = None) -> EngineStart:
    """What a real engine starts with for `plan` (default: the configuration's): its
    quantization_config and layout for that plan, the backend decision, the model."""
    from adapters.engine_start import EngineStart

    report = services.plan_report(services.checkpoint(), plan=plan)
    return EngineStart(report.plan, report.engine_config, report.resolution.layout,
                       services.backend_decision(engine, report.plan), services.config.model.path)


def _vllm_host(services: Services) -> VllmHost:
    from adapters.vllm.factory import VllmHost
    from adapters.vllm.interpreter import host_python

    return VllmHost(python=lambda: host_python(_configured_python(services)), environ=dict(os.environ),
                    export_environment=os.environ.update, embedded_model_dir=services.embedded_model_dir,
                    bucket_bytes=services.bucket_bytes)


def _configured_python(services: Services) -> tuple[str, str] | None:
    from adapters.vllm.interpreter import configured_python

    return configured_python(services.config.rollout.engine_kwargs.vllm.python,
                             services.environ.get("RL_REFIT_VLLM_PYTHON"))


def _vllm_engine(services: Services, plan: QuantizationPlan, **options: Any) -> RolloutEngine:
    from adapters.vllm.factory import build_vllm_engine

    return build_vllm_engine(services.config.rollout.engine_kwargs.vllm, _engine_start(services, "vllm", plan),
                             _vllm_host(services), deployment=services.config.rollout.deployment,
                             commit_mode=options.get("commit_mode"))


def _sglang_engine(services: Services, plan: QuantizationPlan, **options: Any) -> RolloutEngine:
    from adapters.sglang.factory import build_sglang_engine

    rollout = services.config.rollout
    return build_sglang_engine(rollout.engine_kwargs.sglang, _engine_start(services, "sglang", plan),
                               sync_backend=rollout.checkpoint_engine.backend, wire_format=rollout.wire_format,
                               commit_mode=options.get("commit_mode"))


def _reference_trainer(services: Services, model: object | None) -> TrainerModel:
    """The embedded reference model: random weights of reference.model from reference.seed, or,
    with model.path, a Qwen3 / Qwen3-MoE checkpoint's weights at its shapes."""
    from adapters.reference.config import preset
    from adapters.reference.trainer import ReferenceTrainer

    ref = services.config.reference
    checkpoint = services.checkpoint()
    if checkpoint is not None:  # the reference model at the checkpoint's shapes, holding its weights
        return ReferenceTrainer.from_hf_weights(services.reference_config(), checkpoint.iter_tensors())
    return ReferenceTrainer.from_seed(preset(ref.model), ref.seed)


def _megatron_trainer(services: Services, model: object | None) -> TrainerModel:
    from adapters.megatron.factory import megatron_trainer

    if model is None:
        raise ConfigError("actor.strategy", "megatron: pass the built Megatron model, bootstrap(config, model=...)")
    return megatron_trainer(model, services.fused_forward_request().mode,
                            gdn_kernels=services.config.actor.megatron.gdn_kernels)


def _hf_trainer(services: Services, model: object | None) -> TrainerModel:
    """A live transformers model (`model=`), else model.path streamed from its files."""
    from adapters.hf.module import HfModuleTrainer

    if model is not None:
        return HfModuleTrainer(model)
    path = services.config.model.path
    if not path:
        raise ConfigError("actor.strategy", "hf: set model.path to a Hugging Face checkpoint directory, or pass "
                          "the transformers model, bootstrap(config, model=...)")
    if services.config.actor.hf.load_model:  # in memory and trainable (what the demo's steps perturb)
        return HfModuleTrainer.from_pretrained(path)
    from adapters.hf.checkpoint import HfCheckpointTrainer

    return HfCheckpointTrainer.open(path)


def _megatron_sharded(services: Services, model: object, layout: ParallelLayout, rank: int) -> ShardedTrainerModel:
    from adapters.megatron.factory import megatron_sharded

    return megatron_sharded(model, layout, rank)


# rollout.name -> the engine adapter; actor.strategy -> the trainer adapter.
ENGINES: dict[str, AdapterEntry] = {
    "reference": AdapterEntry("adapters.reference.engine.ReferenceEngine", _reference_engine),
    "vllm": AdapterEntry("adapters.vllm.engine.VllmRolloutEngine", _vllm_engine, "vllm", "vllm", remote=True),
    "sglang": AdapterEntry("adapters.sglang.engine.SglangRolloutEngine", _sglang_engine, "sglang", "sglang"),
}
TRAINERS: dict[str, AdapterEntry] = {
    "reference": AdapterEntry("adapters.reference.trainer.ReferenceTrainer", _reference_trainer),
    "megatron": AdapterEntry("adapters.megatron.trainer_model.MegatronTrainerModel", _megatron_trainer,
                             "megatron.core", "megatron", sharded=_megatron_sharded),
    "hf": AdapterEntry("adapters.hf.module.HfModuleTrainer", _hf_trainer, "transformers", "hf"),
}


def _qat_backend(backend: str, numerics: str, layout: str) -> QatBackend:
    if backend == "reference":
        from adapters.qat_reference.backend import ReferenceQatBackend

        return ReferenceQatBackend(layout=layout)
    if backend == "modelopt":
        AdapterEntry("adapters.modelopt.backend.ModelOptQatBackend", lambda: None, "modelopt",
                     "modelopt").require("qat backend", "modelopt")
        from adapters.modelopt.backend import ModelOptQatBackend

        return ModelOptQatBackend(numerics=numerics, layout=layout)
    raise ConfigError("qat backend", f"{backend!r} is not one of reference, modelopt")


# --- the services ------------------------------------------------------------------------------


def _bucket_bytes(megabytes: float) -> int:
    key = "rollout.checkpoint_engine.update_weights_bucket_megabytes"
    if not megabytes > 0 or int(megabytes * 2**20) < 1:
        raise ConfigError(key, f"must be positive, got {megabytes}")
    return int(megabytes * 2**20)


@attrs.define
class Services:
    """The application services of one configuration, built on first use.

    Attributes:
        config: the validated configuration.
        environ: the honoured environment variables, read once.
        trainer: a TrainerModel to use instead of building one (tests, a trainer of the caller's).
        engine: a RolloutEngine to use instead of building one.
        model: the trainer's own model, for trainer kinds that wrap one (`actor.strategy: megatron`).
        progress: refit progress, (source bytes so far, total), e.g. the CLI's progress bar.
    """

    config: RefitConfig
    environ: Mapping[str, str]
    trainer: TrainerModel | None = None
    engine: RolloutEngine | None = None
    model: object | None = None
    progress: Progress | None = None
    _plan: QuantizationPlan | None = attrs.field(init=False, default=None)

    # --- configuration -------------------------------------------------------------------------

    @property
    def plan(self) -> QuantizationPlan:
        """The rollout quantization plan the configuration resolves to (no model read)."""
        if self._plan is None:
            self._plan = self.plan_report().plan
        return self._plan

    @property
    def bucket_bytes(self) -> int:
        return _bucket_bytes(self.config.rollout.checkpoint_engine.update_weights_bucket_megabytes)

    @property
    def commit_mode(self) -> CommitMode | None:
        """rollout.commit_mode, or None to take the engine's own."""
        value = self.config.rollout.commit_mode
        return None if value is None else CommitMode.parse(value)

    def checkpoint(self, path: str | None = None) -> HfCheckpoint | None:
        """The Hugging Face checkpoint at `path` (default model.path; None without one)."""
        path = path or self.config.model.path
        if not path:
            return None
        from adapters.hf_checkpoint.reader import HfCheckpoint

        return HfCheckpoint(path)

    def plan_report(self, checkpoint: HfCheckpoint | None = None, *, purpose: str = "refit",
                    plan: QuantizationPlan | None = None) -> PlanReport:
        """Every decision of the rollout quantization, for the configuration (and a checkpoint).

        Args:
            checkpoint: the model (only its headers are read), or None.
            purpose: "refit" (a refit will send these tensors) or "export" (`refit export`: a
                native layout the trainer cannot produce is copied untouched).
            plan: the plan refits send, when it is not the configuration's (the report is then
                that plan's).
        """
        from app.services.planning import make_plan

        return make_plan(self.config, checkpoint, purpose=purpose, profile=self.engine_profile(), plan=plan)

    def engine_profile(self) -> EngineProfile:
        """The rollout engine's profile (support table, layouts, rules, backend policy, pins):
        PROFILES[rollout.name]."""
        return profile_for(self.config.rollout.name)

    # --- refits --------------------------------------------------------------------------------

    def trainer_model(self) -> TrainerModel:
        """The trainer: the one given, else built by TRAINERS[actor.strategy] (kept)."""
        if self.trainer is None:
            name = self.config.actor.strategy
            entry = TRAINERS.get(name)
            if entry is None:
                raise ConfigError("actor.strategy", f"{name!r} has no trainer adapter; use one of {', '.join(TRAINERS)} "
                                  "or pass your TrainerModel: bootstrap(config, trainer=...)")
            entry.require("actor.strategy", name)
            self.trainer = entry.build(self, self.model)
        return self.trainer

    def rollout_engine(self, plan: QuantizationPlan | None = None, *, commit_mode: CommitMode | None = None,
                       kv_cache_scheme: Mapping[str, object] | None = None) -> RolloutEngine:
        """A new engine from ENGINES[rollout.name] (the one given to bootstrap, if any)."""
        if self.engine is not None:
            return self.engine
        name = self.config.rollout.name
        entry = ENGINES.get(name)
        if entry is None:
            raise ConfigError("rollout.name", f"{name!r} has no engine adapter; use one of {', '.join(ENGINES)}")
        if self.config.rollout.deployment == "colocated":
            entry.require("rollout.name", name)
        elif not entry.remote:
            raise ConfigError("rollout.deployment", f"{name} runs colocated only (in this process); set "
                              "rollout.deployment=colocated")
        return entry.build(self, plan or self.plan, commit_mode=commit_mode or self.commit_mode,
                           kv_cache_scheme=kv_cache_scheme)

    def refit_service(
        self,
        *,
        plan: QuantizationPlan | None = None,
        trainer: TrainerModel | None = None,
        engine: RolloutEngine | None = None,
        inject_fault: str | None = None,
        fault_after: int = 0,
        kv_cache_scheme: Mapping[str, object] | None = None,
        restore: str | None = None,
    ) -> RefitService:
        """A RefitService from the trainer into the engine.

        Args:
            plan: the rollout plan (default: the configuration's).
            trainer: a trainer to use (default: `trainer_model()`).
            engine: an engine to use (default: a new `rollout_engine(plan)`).
            inject_fault: `[hang:]bucket:K`, `begin`, `finalize`, `verify` or `storage`: the
                engine, wrapped in ScriptedFaultyEngine, fails there once (demos, tests).
            fault_after: refits that succeed before the injected fault fires.
            kv_cache_scheme: the quantization config's kv_cache_scheme (None = uncalibrated).
            restore: `replay`, `engine` or `stale` (default: `rollout.checkpoint_engine.restore`;
                null there: the default for the engine's commit mode and the bucket ownership,
                app.services.transaction.Restore.default).

        Returns:
            The RefitService: buckets by reference to an engine in this process
            (`rollout.deployment: colocated`), packed into one reused buffer for an engine in
            processes of its own (`disaggregated`: its transport copies each bucket out).
        """
        from app.services.refit import RefitService
        from app.services.transaction import Ownership

        plan = plan or self.plan
        engine = engine or self.rollout_engine(plan, kv_cache_scheme=kv_cache_scheme)
        if inject_fault:
            from adapters.memory.faults import FaultScript
            from adapters.memory.faulty import ScriptedFaultyEngine

            try:
                script = attrs.evolve(FaultScript.parse(inject_fault), after=fault_after)
            except ValueError as err:
                raise ConfigError("--inject-fault", str(err)) from None
            engine = ScriptedFaultyEngine(engine, script)
        trainer = trainer or self.trainer_model()
        colocated = self.config.rollout.deployment == "colocated"
        return RefitService(trainer, engine, plan, bucket_bytes=self.bucket_bytes, progress=self.progress,
                            probe=self.post_refit_probe(trainer),
                            restore=restore or self.config.rollout.checkpoint_engine.restore,
                            ownership=Ownership.BY_REFERENCE if colocated else Ownership.REUSED,
                            delta=self.delta_sender())

    def delta_sender(self) -> DeltaSender | None:
        """The trainer's delta sender when `rollout.checkpoint_engine.backend` is layout_delta, else None."""
        ce = self.config.rollout.checkpoint_engine
        if ce.backend != LAYOUT_DELTA_BACKEND:
            return None
        return DeltaSender(full_every=ce.delta.full_every, max_host_bytes=ce.delta.max_host_bytes)

    def mismatch_probe(self, service: RefitService, temperature: float = 1.0) -> MismatchProbe:
        """A MismatchProbe over a refit service's trainer and engine."""
        from app.services.mismatch_probe import MismatchProbe

        return MismatchProbe(service.trainer, service.engine, temperature)

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
            fault: an adapters.memory.faults.RankFault (tests, demos): the ports of the rank it
                hits are wrapped to fail there.
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
        from domain.refit.topology import Role

        if self.config.rollout.checkpoint_engine.backend == LAYOUT_DELTA_BACKEND:
            raise ConfigError("rollout.checkpoint_engine.backend", "layout_delta runs on the single-process refit "
                              "(refit_service); the distributed refit sends every tensor: use 'naive'")

        plan = plan or self.plan
        own_model = model is not None or self.config.actor.strategy != "reference"
        trainer: ShardedTrainerModel | None = None
        if world.role(rank) is Role.TRAINER:
            trainer = self._sharded_trainer(model, world, rank) if own_model else self._sliced_trainer(world, rank)
        else:
            engine = engine or self.rollout_engine(plan)
        ports, shapes = wire_rank(
            world, rank, plan, trainer=trainer, engine=engine, own_model=own_model,
            strategy=self.config.actor.strategy, shapes=shapes, default_shapes=self._preset_shapes, comm=comm,
            bucket_bytes=self.bucket_bytes, timeouts=RankTimeouts(step_timeout_s, phase_timeout_s, window),
            fault=fault, hang_s=hang_s,
        )
        probe = None
        if world.role(rank) is Role.ENGINE and self.config.rollout.verify.enabled:
            if reference is None:
                raise ConfigError("rollout.verify.enabled", f"rank {rank} is an engine rank: its post-refit probe "
                                  "needs the trainer's weights; pass distributed_refit(..., reference=<a full trainer "
                                  "model>), or set rollout.verify.enabled=false")
            probe = self.post_refit_probe(reference)
        return DistributedRefitService(
            world, ports.comm, plan, shapes, trainer=ports.trainer, engine=ports.engine,
            bucket_bytes=self.bucket_bytes, window=window,
            restore=restore or self.config.rollout.checkpoint_engine.restore, probe=probe,
        )

    def _preset_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        from adapters.reference.config import hf_weight_shapes, preset

        return hf_weight_shapes(preset(self.config.reference.model))

    def _sliced_trainer(self, world: RefitWorld, rank: int) -> ShardedTrainerModel:
        """This trainer rank's slice of the embedded reference model (or of the trainer given)."""
        from adapters.distributed.sliced_trainer import SlicedTrainer
        from adapters.reference.config import preset
        from adapters.reference.trainer import ReferenceTrainer

        full = self.trainer or ReferenceTrainer.from_seed(preset(self.config.reference.model), self.config.reference.seed)
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
        return entry.sharded(self, model, world.layout, rank)

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

    def megatron_demo_kit(self) -> Any:
        """What `refit demo --trainer megatron` needs from Megatron-Core on CPU, for the
        `reference.model` architecture and `reference.seed` (adapters.megatron.demo_kit)."""
        TRAINERS["megatron"].require("actor.strategy", "megatron")
        from adapters.megatron.demo_kit import MegatronDemoKit
        from adapters.reference.config import preset

        return MegatronDemoKit(preset(self.config.reference.model), self.config.reference.seed)

    def reference_config(self) -> Any:
        """The embedded reference model's shapes (adapters.reference.config.ReferenceModelConfig):
        reference.model's, or with model.path and actor.strategy reference, the checkpoint's
        (a Qwen3 / Qwen3-MoE config.json; CheckpointError otherwise)."""
        from adapters.reference.config import preset

        checkpoint = self.checkpoint() if self.config.actor.strategy == "reference" else None
        if checkpoint is not None:
            from adapters.reference.hf import config_from_hf

            return config_from_hf(checkpoint.config, str(checkpoint.path / "config.json"))
        return preset(self.config.reference.model)

    def reference_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """The embedded reference model's (Hugging Face name, shape) pairs, in layer order."""
        from adapters.reference.config import hf_weight_shapes

        return hf_weight_shapes(self.reference_config())

    def embedded_model_dir(self) -> Path:
        """A directory holding the embedded model's `config.json` (Qwen3 / Qwen3-MoE), for an
        engine that starts with dummy weights and receives the real ones by refit."""
        import tempfile

        from adapters.reference.hf import write_config

        return write_config(self.reference_config(), tempfile.mkdtemp(prefix=f"rl-refit-{self.config.reference.model}-"))

    def write_checkpoint(self, trainer: TrainerModel, directory: str | Path) -> Path:
        """The trainer's current weights as a BF16 Hugging Face checkpoint (the source `export`
        quantizes, e.g. for an engine's cold start): the embedded model's config.json, or with
        actor.strategy hf the source checkpoint's (adapters.hf.module.HfModuleTrainer.save)."""
        save = getattr(trainer, "save", None)
        if self.config.actor.strategy == "hf" and callable(save):  # adapters.hf.module: the source's config.json
            return Path(save(directory))
        if self.config.actor.strategy == "hf":
            raise ConfigError("actor.hf.load_model", "a checkpoint directory streamed is not written again; set "
                              "actor.hf.load_model: true for a trainer whose weights change")
        from adapters.reference.hf import write_checkpoint

        return write_checkpoint(self.reference_config(), trainer.named_weights(), directory)

    def export_trainer(self, trainer: TrainerModel, out: str | Path) -> Path:
        """Export the embedded trainer's current weights with the configuration's plan into
        `out` (replaced): what an engine started cold from it serves."""
        import tempfile

        from app.services.checkpoint_export import export_checkpoint

        with tempfile.TemporaryDirectory(prefix="rl-refit-bf16-") as src:
            checkpoint = self.checkpoint(str(self.write_checkpoint(trainer, src)))
            assert checkpoint is not None
            export_checkpoint(checkpoint, out, self.plan_report(checkpoint, purpose="export"), force=True)
        return Path(out)

    def vllm_python(self) -> str:
        """The interpreter a disaggregated vLLM engine host runs with: rollout.engine_kwargs.vllm.python,
        else RL_REFIT_VLLM_PYTHON, else ./.venv-vllm/bin/python (or the one beside this checkout),
        else this interpreter."""
        from adapters.vllm.interpreter import vllm_python

        return vllm_python(_configured_python(self))

    def cold_start(self, directory: str | Path) -> Any:
        """An engine of rollout.name started from a checkpoint directory in its own process, for
        comparisons (log_probs, greedy, digests, kv_scales, close); vllm only."""
        name = self.config.rollout.name
        if name != "vllm":
            raise ConfigError("rollout.name", f"cold starts for comparison are built for vllm only, not {name!r}")
        from adapters.vllm.factory import vllm_cold_start

        return vllm_cold_start(self.config.rollout.engine_kwargs.vllm, _engine_start(self, "vllm"), _vllm_host(self),
                               str(directory))

    def post_refit_probe(self, trainer: TrainerModel) -> PostRefitProbe | None:
        """The post-refit probe of rollout.verify (app.services.verification.trainer_probe)."""
        from app.services.verification import trainer_probe

        return trainer_probe(trainer, self.config.rollout.verify, self.plan,
                             embedded_engine=self.config.rollout.name == "reference")

    def rank_fault(self, text: str, rank: int, refit: int) -> Any:
        """An adapters.memory.faults.RankFault from its spelling; ConfigError names --inject-fault."""
        from adapters.memory.faults import RankFault

        try:
            return RankFault.parse(text, rank, refit=refit)
        except ValueError as err:
            raise ConfigError("--inject-fault", str(err)) from None

    def launch_world(self, fn: Callable[..., Any], size: int, args: Sequence[Any] = (), *,
                     timeout_s: float = 120.0, start_method: str = "fork") -> list[Any]:
        """Run `fn(rank, *args)` in `size` local processes joined over gloo on 127.0.0.1
        (adapters.distributed.launch); returns one RankResult per rank. `start_method`
        `forkserver` starts them from a clean process (fn and args then travel pickled): what a
        world of Megatron-Core ranks needs once this process has run Megatron itself."""
        from adapters.distributed.launch import launch_world

        return launch_world(fn, size, args, timeout_s=timeout_s, start_method=start_method)

    # --- the trainer's side --------------------------------------------------------------------

    def embedded_module(self) -> torch.nn.Module:
        """A new trainable copy (torch.nn.Module) of the embedded reference model of
        `reference.model` and `reference.seed`; its `trainer()` is its TrainerModel view."""
        from adapters.qat_reference.embedded import EmbeddedModule
        from adapters.reference.config import preset

        return EmbeddedModule.from_seed(preset(self.config.reference.model), self.config.reference.seed)

    def fused_forward_request(self) -> FusedForwardRequest:
        """The fused-forward mode asked for: `actor.fused_forward` wins; else `VERL_FUSED_USE_OP_HOOK`
        as read by bootstrap; else auto (FusedForwardModeError names the key or the variable)."""
        from domain.forward.mode import FusedForwardRequest

        return FusedForwardRequest.from_settings(self.config.actor.fused_forward,
                                                 self.environ.get("VERL_FUSED_USE_OP_HOOK"))

    def logprob_service(self, model: object | None = None, *, chunk_size: int | None = None) -> LogProbService:
        """A LogProbService over a Megatron GPTModel (wrappers allowed) or any TrainerModel.

        The fused-forward mode is decided once (`fused_forward_request`). A Megatron model with
        GatedDeltaNet layers also gets packed (THD) GDN input made safe (`packed_gdn`).

        Args:
            model: a Megatron model, or an object that already is a TrainerModel (default: the
                model given to bootstrap).
            chunk_size: tokens per chunk of the fused computation (None: sized from the vocabulary).

        Returns:
            The LogProbService. Raises FusedForwardModeError (a value that is not a mode, naming
            the key or the variable) and FusedHookUnavailable (hook required, forward lacks it).
        """
        from app.services.logprob import LogProbService, is_trainer_model

        model = model if model is not None else self.model
        request = self.fused_forward_request()
        if is_trainer_model(model):
            return LogProbService(model, mode="none", source=request.source)
        TRAINERS["megatron"].require("actor.strategy", "megatron")
        from adapters.megatron.factory import megatron_trainer

        trainer = megatron_trainer(model, request.mode, gdn_kernels=self.config.actor.megatron.gdn_kernels,
                                   chunk_size=chunk_size)
        return LogProbService(trainer, mode=trainer.mode.value, source=request.source)

    def packed_gdn(self, model: object) -> PackedGdnReport:
        """Let a built Megatron model's GatedDeltaNet layers take packed (THD) input safely.

        A no-op without GDN layers; validation hooks only on Megatron-Core >= 0.18; the
        packed-aware forward before that, with the kernels of `actor.megatron.gdn_kernels`.
        """
        from adapters.megatron.factory import packed_gdn

        return packed_gdn(model, self.config.actor.megatron.gdn_kernels)

    def qat(self, model: torch.nn.Module, *, backend: str = "reference", numerics: str = "exporter",
            layout: str = "auto", model_config: Mapping[str, object] | None = None,
            qat_backend: QatBackend | None = None) -> QatSession | None:
        """QAT for a built trainer model, per actor.megatron.qat.* and the rollout quantization
        (app.services.qat_setup.prepare_qat: the plan on the model's tensors, the settings checked
        against it, the backend applied, every layer's effective precision checked).

        Args:
            model: the trainer model (torch / transformers module, Megatron-Core model on one
                rank, or the embedded model as adapters.qat_reference.embedded.EmbeddedModule).
            backend: "reference" (pure torch) or "modelopt" (nvidia-modelopt).
            numerics: ModelOpt only: "exporter" (default) or "modelopt" (its own kernels, checked).
            layout: the name mapping: "auto", "torch", "megatron" or "reference".
            model_config: the checkpoint's config.json, when there is one.
            qat_backend: a QatBackend to use instead of building one (tests, custom backends).

        Returns:
            The QatSession (call its refresh() after every optimizer step), or None when
            actor.megatron.qat.enable is false.
        """
        from adapters.qat_reference.layouts import weight_shapes
        from app.services.qat_setup import prepare_qat

        if not self.config.actor.megatron.qat.enable:
            return None
        if qat_backend is None:
            qat_backend = _qat_backend(backend, numerics, layout)
        return prepare_qat(self.config, model, qat_backend, weight_shapes(model, layout), model_config=model_config)

    # --- engines' kernels and the machine ------------------------------------------------------

    def deep_gemm_opt_out(self, engine: str, environ: Mapping[str, str] | None = None) -> bool:
        """Whether DeepGEMM requests are off: `rollout.engine_kwargs.<engine>.use_deep_gemm: false`
        or `VERL_ROLLOUT_USE_DEEP_GEMM=0` (either restores the engine's automatic selection).

        Args:
            engine: "vllm" or "sglang".
            environ: the honoured variables to judge (default: those bootstrap read).

        Returns:
            True to opt out. Raises ConfigError naming the key or variable on a value that is not
            a switch.
        """
        section = self.config.rollout.engine_kwargs.engine(engine)
        value = None if section is None else section.use_deep_gemm
        env = (self.environ if environ is None else environ).get("VERL_ROLLOUT_USE_DEEP_GEMM")
        if env is not None and env.strip().lower() not in _ON + _OFF:
            raise ConfigError("VERL_ROLLOUT_USE_DEEP_GEMM", f"expected 1 or 0 (true/false), got {env!r}")
        return value is False or (env is not None and env.strip().lower() in _OFF)

    def backend_decision(self, engine: str, plan: QuantizationPlan,
                         capability: tuple[int, int] | None = None) -> BackendDecision:
        """The kernel backends for a rollout engine (ARCHITECTURE.md section 5), opt-out applied.

        Args:
            engine: "vllm" or "sglang".
            plan: the resolved plan.
            capability: the GPU's compute capability; None skips the capability gates.
        """
        return backend_decision(engine, plan, capability, opt_out=self.deep_gemm_opt_out(engine))

    def environment_probe(self, snapshot_file: str | None = None) -> EnvironmentProbe:
        """The EnvironmentProbe `refit doctor` inspects: this machine, or a saved snapshot.

        Args:
            snapshot_file: a JSON file written by `refit doctor --json` (its `environment`
                object is used); None probes this machine.
        """
        if snapshot_file is None:
            from adapters.system.probe import SystemProbe

            vllm_python: str | None = self.vllm_python()
            if vllm_python == sys.executable and importlib.util.find_spec("vllm") is None:
                vllm_python = None  # no vLLM environment to ask
            return SystemProbe(environ=dict(self.environ), vllm_python=vllm_python,
                               cpu_emulation=self.config.rollout.engine_kwargs.vllm.cpu_emulation)
        from app.services.doctor import snapshot_probe

        return snapshot_probe(snapshot_file)


def bootstrap(
    config: Mapping[str, Any] | str | Path | RefitConfig | None = None,
    *,
    overrides: Sequence[str] = (),
    trainer: TrainerModel | None = None,
    engine: RolloutEngine | None = None,
    model: object | None = None,
    progress: Progress | None = None,
    environ: Mapping[str, str] | None = None,
) -> Services:
    """The application services for a configuration.

    Args:
        config: a configuration dict, a YAML file, an already validated RefitConfig, or None
            (defaults: the embedded reference trainer and engine).
        overrides: dotted `KEY=VALUE` overrides applied after `config`.
        trainer: a TrainerModel to refit from instead of building one.
        engine: a RolloutEngine to refit into instead of building one.
        model: the trainer's own model for trainer kinds that wrap one (Megatron).
        progress: refit progress callback, (source bytes so far, total).
        environ: the environment to read the honoured variables from (default: this process's).

    Returns:
        The Services. Raises the configuration's typed errors (ConfigError naming the key).
    """
    cfg = config if isinstance(config, RefitConfig) and not overrides else load_config(
        config.to_dict() if isinstance(config, RefitConfig) else config, overrides)
    return Services(cfg, read_environment(environ), trainer=trainer, engine=engine, model=model, progress=progress)
