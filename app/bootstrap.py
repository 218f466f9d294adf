"""The composition root: the only module that reads the configuration and the environment.

`bootstrap(config, ...)` validates a verl-style configuration, reads the honoured environment
variables once, and returns `Services`: the refit's services, built on first use with the adapters
the configuration names (app.composition.tables: ENGINES by `rollout.name`, TRAINERS by
`actor.strategy`), and the rest of the wiring by job (`world`, `embedded`, `engines`,
`trainer_side`, `lora`; app/composition/). The wiring receives what it needs, the configuration,
values and callables, never the Services: app/composition/ imports nothing from here. The CLI, the
demos and the benchmarks call it; tests call it with fakes (`trainer=`, `engine=`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from adapters.engine_plugin import DEPLOYMENTS
from adapters.plugins import DEMO_ENGINES as DEMO_ENGINES  # for the CLI, which names no adapter
from adapters.plugins import ENVIRONMENT, PLUGINS, plugin_for
from adapters.plugins import demo_of as demo_of  # for the CLI
from adapters.profiles import POLICY_ENGINES as POLICY_ENGINES  # for the CLI
from adapters.profiles import profile_for
from app.composition.embedded import EmbeddedWiring
from app.composition.engines import EngineWiring
from app.composition.tables import (
    TRAINERS,
    BuildContext,
    engine_request,
    engine_start,
    native_codecs,
    with_fault,
)
from app.config import load_config
from app.config_sections import RefitConfig
from domain.errors import ConfigError, ConfigTypeError
from domain.quant.plan import QuantizationPlan
from domain.quant.rules import LAYOUT_DELTA_BACKEND
from domain.refit.session import CommitMode

if TYPE_CHECKING:
    from adapters.engine_plugin import EngineHost
    from adapters.engine_start import EngineStart
    from adapters.hf_checkpoint.reader import HfCheckpoint
    from app.composition.lora import LoraWiring
    from app.composition.trainer_side import TrainerWiring
    from app.composition.world import WorldWiring
    from app.services.mismatch_probe import MismatchProbe
    from app.services.planning import PlanReport
    from app.services.refit import Progress, RefitService
    from app.services.verification import PostRefitProbe
    from domain.mismatch_sentinel import MismatchSentinel
    from domain.refit.delta_sync import DeltaSender
    from ports.engine_profile import EngineProfile
    from ports.rollout_engine import RolloutEngine
    from ports.trainer_model import TrainerModel

# The environment variables rl-refit honours (read once, here, and passed down as values).
ENV_VARS = ("VERL_FUSED_USE_OP_HOOK", "VERL_ROLLOUT_USE_DEEP_GEMM", *ENVIRONMENT)


def read_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The honoured environment variables that are set (default: this process's environment)."""
    env = os.environ if environ is None else environ
    return {name: env[name] for name in ENV_VARS if name in env}



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
    # the rest of the wiring, by job (app/composition/): the distributed refit, the embedded model,
    # the engines besides refits, the trainer's own model, LoRA's adapter mode; and what the
    # adapter tables' builders take. Each gets the configuration, values and callables.
    embedded: EmbeddedWiring = attrs.field(init=False, repr=False, eq=False)
    engines: EngineWiring = attrs.field(init=False, repr=False, eq=False)
    _build: BuildContext = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        config = self.config
        self.embedded = EmbeddedWiring(config, self.checkpoint, self.plan_report)
        self.engines = EngineWiring(config, self.environ, self.engine_start, self.engine_host)
        self._build = BuildContext(config, self.checkpoint, self.embedded.reference_config, self.engine_start,
                                   self.engine_host, lambda: self.trainer_side.fused_forward_request().mode)

    # The wiring of one job each, imported and built on first use: a command loads only the jobs it runs.
    @functools.cached_property
    def world(self) -> WorldWiring:
        """Refit worlds: distributed refits, their launch, replicas, faults (app.composition.world)."""
        from app.composition.world import WorldWiring

        return WorldWiring(self.config, lambda: self.plan, lambda: self.trainer, self.rollout_engine,
                           self.post_refit_probe)

    @functools.cached_property
    def trainer_side(self) -> TrainerWiring:
        """The trainer's fused forward and its hooks (app.composition.trainer_side)."""
        from app.composition.trainer_side import TrainerWiring

        return TrainerWiring(self.config, self.environ, lambda: self.model)

    @functools.cached_property
    def lora(self) -> LoraWiring:
        """LoRA adapters: their sync services and engines (app.composition.lora)."""
        from app.composition.lora import LoraWiring

        return LoraWiring(self.config, self.trainer_model, lambda: self.plan, self.refit_service)

    # --- configuration -------------------------------------------------------------------------

    @property
    def plan(self) -> QuantizationPlan:
        """The rollout quantization plan the configuration resolves to (no model read)."""
        if self._plan is None:
            self._plan = self.plan_report().plan
        return self._plan

    @property
    def bucket_bytes(self) -> int:
        return self.config.rollout.checkpoint_engine.bucket_bytes

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

    def check_checkpoint_config(self, path: str | None = None) -> None:
        """The checkpoint's config.json against its tensors, before anything is built from it
        (adapters.hf_checkpoint.config_checks): CheckpointError naming the key; nothing without a
        checkpoint."""
        checkpoint = self.checkpoint(path)
        if checkpoint is not None:
            from adapters.hf_checkpoint.config_checks import check_checkpoint_config

            check_checkpoint_config(checkpoint)

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

        _check_arguments(plan=plan)
        return make_plan(self.config, checkpoint, purpose=purpose, profile=self.engine_profile(), plan=plan)

    def check_environment(self) -> None:
        """Validate the honoured variables now, not when a model or an engine is built (`refit plan`).

        Raises FusedForwardModeError naming VERL_FUSED_USE_OP_HOOK (or actor.fused_forward) for a
        value that is not a fused-forward mode, and ConfigError naming VERL_ROLLOUT_USE_DEEP_GEMM
        for one that is not a switch.
        """
        from domain.forward.mode import ENV_VAR, parse_fused_forward_mode

        if self.environ.get(ENV_VAR) is not None:  # checked even where actor.fused_forward wins over it
            parse_fused_forward_mode(self.environ[ENV_VAR], key=ENV_VAR)
        self.trainer_side.fused_forward_request()
        self.engines.deep_gemm_opt_out(self.config.rollout.name)

    def engine_start(self, engine: str, plan: QuantizationPlan | None = None) -> EngineStart:
        """What the real engine `engine` starts with for `plan` (default: the configuration's): its
        quantization_config and layout for that plan, the backend decision, the model."""
        return engine_start(self.plan_report(self.checkpoint(), plan=plan), self.embedded.reference_config,
                            functools.partial(self.engines.backend_decision, engine), self.config.model.path)

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
            self.trainer = entry.build(self._build, self.model)
        return self.trainer

    def rollout_engine(self, plan: QuantizationPlan | None = None, *, commit_mode: CommitMode | None = None,
                       kv_cache_scheme: Mapping[str, object] | None = None) -> RolloutEngine:
        """A new engine from ENGINES[rollout.name] (the one given to bootstrap, if any)."""
        _check_arguments(plan=plan)
        if self.engine is not None:
            return self.engine
        rollout = self.config.rollout
        plugin = plugin_for(rollout.name)
        if plugin.build is None:
            raise ConfigError("rollout.name", f"{rollout.name!r} has no engine adapter; use one of "
                              f"{', '.join(p.name for p in PLUGINS.values() if p.build is not None)}")
        replicas = plugin.replicas(rollout.engine_kwargs.engine(plugin.name), rollout.deployment, rollout.replicas)
        if rollout.deployment not in plugin.deployments:
            runs = " or ".join(d for d in DEPLOYMENTS if d in plugin.deployments)
            raise ConfigError("rollout.deployment", f"{plugin.name} runs {runs} only; set "
                              f"rollout.deployment={'colocated' if len(plugin.deployments) == 1 else runs}")
        if rollout.deployment == "colocated":
            plugin.require("rollout.name")
        engines = []
        try:
            for replica in range(replicas):
                engines.append(plugin.build(engine_request(self._build, plugin, plan or self.plan, replica=replica,
                                                           commit_mode=commit_mode or self.commit_mode,
                                                           kv_cache_scheme=kv_cache_scheme)))
        except BaseException:  # no replica is left running when another fails to start
            for started in engines:
                close = getattr(started, "close", None)
                if close is not None:
                    close()
            raise
        if replicas == 1:
            return engines[0]
        from app.services.replicas import ReplicatedEngine

        return ReplicatedEngine(engines)

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
            The RefitService: buckets by reference when colocated, and when a disaggregated
            engine's buckets travel through a transport that copies each tensor out itself (the
            shared-memory ring: the trainer writes each tensor into it, and that copy is the
            bucket's only packing); otherwise packed into one reused buffer (the transport copies
            each bucket out).
        """
        from app.services.refit import RefitService
        from app.services.transaction import Ownership

        _check_arguments(plan=plan, inject_fault=inject_fault, fault_after=fault_after, restore=restore)
        plan = plan or self.plan
        engine = engine or self.rollout_engine(plan, kv_cache_scheme=kv_cache_scheme)
        if inject_fault:
            engine = with_fault(engine, inject_fault, fault_after)
        trainer = trainer or self.trainer_model()
        rollout = self.config.rollout
        by_reference = plugin_for(rollout.name).by_reference(rollout.engine_kwargs.engine(rollout.name),
                                                             rollout.deployment)
        return RefitService(trainer, engine, plan, bucket_bytes=self.bucket_bytes, progress=self.progress,
                            probe=self.post_refit_probe(trainer),
                            restore=restore or self.config.rollout.checkpoint_engine.restore,
                            ownership=Ownership.BY_REFERENCE if by_reference else Ownership.REUSED,
                            delta=self.delta_sender(), native_codecs=native_codecs)

    def delta_sender(self) -> DeltaSender | None:
        """The trainer's delta sender when `rollout.checkpoint_engine.backend` is layout_delta, else None."""
        ce = self.config.rollout.checkpoint_engine
        if ce.backend != LAYOUT_DELTA_BACKEND:
            return None
        from domain.refit.delta_sync import DeltaSender

        return DeltaSender(full_every=ce.delta.full_every, max_host_bytes=ce.delta.max_host_bytes)

    def mismatch_probe(self, service: RefitService, temperature: float = 1.0) -> MismatchProbe:
        """A MismatchProbe over a refit service's trainer and engine."""
        from app.services.mismatch_probe import MismatchProbe

        return MismatchProbe(service.trainer, service.engine, temperature)

    def mismatch_sentinel(self, threshold: float | None = None, *, plan: QuantizationPlan | None = None) -> MismatchSentinel:
        """The MismatchSentinel of this configuration, armed by the exporter's rule: rollout.quantization
        (linear, moe, config_file), else the native quantization_config of model.path's config.json
        (a local directory only; a hub id or a missing path has none to read).

        Args:
            threshold: the k3 KL spike threshold (default domain.mismatch_sentinel.DEFAULT_K3_THRESHOLD).
            plan: a plan to judge instead of rollout.quantization's linear and moe (`refit mismatch`).
        """
        from adapters.hf_checkpoint.reader import local_model_config
        from domain.mismatch_sentinel import DEFAULT_K3_THRESHOLD, MismatchSentinel
        from domain.quant.native_config import find_quantization_config, quant_method

        q = self.config.rollout.quantization
        linear, moe, config_file = q.linear, q.moe, q.config_file
        if plan is not None:
            linear, moe, config_file = plan.linear.name, plan.moe.name, None
        native = find_quantization_config(local_model_config(self.config.model.path))
        return MismatchSentinel.for_rollout(linear, moe, config_file, None if native is None else quant_method(native[1]),
                                            DEFAULT_K3_THRESHOLD if threshold is None else threshold)

    def post_refit_probe(self, trainer: TrainerModel) -> PostRefitProbe | None:
        """The post-refit probe of rollout.verify (app.services.verification.trainer_probe)."""
        from app.services.verification import trainer_probe

        return trainer_probe(trainer, self.config.rollout.verify, self.plan,
                             embedded_engine=plugin_for(self.config.rollout.name).embedded)

    def engine_host(self) -> EngineHost:
        """What this process offers the engines it builds: its environment (read here, the
        composition root), the honoured variables, the embedded model."""
        from adapters.engine_plugin import EngineHost

        return EngineHost(environ=dict(os.environ), honoured=self.environ, export_environment=os.environ.update,
                          embedded_model_dir=self.embedded.model_dir, embedded_config=self.embedded.reference_config,
                          embedded_device=self.config.reference.device, bucket_bytes=self.bucket_bytes,
                          cpus=tuple(sorted(os.sched_getaffinity(0))))


def _check_arguments(**given: object) -> None:
    """ConfigTypeError for an argument of a public entry point that has the wrong type, naming it
    (instead of an AttributeError deep inside)."""
    expected: dict[str, tuple[type, ...]] = {"plan": (QuantizationPlan,), "inject_fault": (str,),
                                             "fault_after": (int,), "restore": (str,)}
    hints = {"plan": "QuantizationPlan.from_presets(linear='FP8_BLOCK', moe='NVFP4'), or None for the configuration's"}
    for name, value in given.items():
        types = expected[name]
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            hint = f"; pass {hints[name]}" if name in hints else ""
            raise ConfigTypeError(name, f"expected {' or '.join(t.__name__ for t in types)}, got "
                                  f"{type(value).__name__} {value!r:.80}{hint}")


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
