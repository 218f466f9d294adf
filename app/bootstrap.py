"""The composition root: the only place that reads configuration and the environment.

It builds adapters (importing heavy ones inside the branch that selects them) and hands back
application services. Tests call the same functions with fakes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def read_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment variables rl-refit honours, read once here and passed down as values."""
    env = os.environ if environ is None else environ
    names = ("VERL_FUSED_USE_OP_HOOK", "VERL_ROLLOUT_USE_DEEP_GEMM")
    return {name: env[name] for name in names if name in env}


def apply_packed_gdn(model: object, config: Mapping[str, object] | None = None):
    """After a Megatron model is built: let its GatedDeltaNet layers take packed (THD) input.

    A no-op without GDN layers; validation hooks only on Megatron-Core >= 0.18; the packed-aware
    forward before that, with the kernels named by `actor.megatron.gdn_kernels` ("auto" default:
    reference on CPU, fla on CUDA; or "reference", "fla", "causal_conv1d").

    Returns:
        app.services.packed_gdn.PackedGdnReport.
    """
    from adapters.megatron.gdn_kernels import KERNEL_SETS
    from app.services.packed_gdn import apply_packed_gdn as apply
    from domain.errors import ConfigError

    actor = (config or {}).get("actor") or {}
    megatron = (actor.get("megatron") if isinstance(actor, Mapping) else None) or {}
    kernels = megatron.get("gdn_kernels", "auto") if isinstance(megatron, Mapping) else "auto"
    if kernels not in KERNEL_SETS:
        raise ConfigError("actor.megatron.gdn_kernels", f"{kernels!r} is not one of {', '.join(KERNEL_SETS)}")
    return apply(model, kernels=kernels)  # type: ignore[arg-type]


# --- refit: the service, the mismatch probe and the embedded default model -------------------


def build_plan(
    linear: str | None = "FP8_BLOCK",
    moe: str | None = "NVFP4",
    *,
    moe_activation: str | None = None,
    ignore: tuple[str, ...] = (),
    scale_rule: str = "rceil",
):
    """A QuantizationPlan from preset names (None = BF16); ConfigError names a bad key.

    Returns:
        domain.quant.plan.QuantizationPlan.
    """
    from domain.quant.plan import QuantizationPlan

    return QuantizationPlan.from_presets(
        linear=linear, moe=moe, moe_activation=moe_activation, ignore=ignore, scale_rule=scale_rule
    )


def build_refit_service(
    *,
    plan: object | None = None,
    model: str = "tiny-moe",
    seed: int = 0,
    commit_mode: str = "transactional",
    bucket_megabytes: float = 512,
    inject_fault: str | None = None,
    fault_after: int = 0,
    kv_cache_scheme: Mapping[str, object] | None = None,
    progress: bool = False,
    trainer: object | None = None,
    engine: object | None = None,
):
    """A RefitService on the embedded reference model (or on the trainer/engine given).

    Args:
        plan: a QuantizationPlan (default: build_plan(), i.e. linear FP8_BLOCK, moe NVFP4).
        model: reference model preset (`tiny-moe`, `tiny-dense`, `bench-moe`).
        seed: seed of the trainer's random weights.
        commit_mode: `transactional` or `per-layer` (reference engine).
        bucket_megabytes: bucket capacity, MiB (rollout.checkpoint_engine.update_weights_bucket_megabytes).
        inject_fault: `bucket:K`, `finalize` or `verify`: wrap the engine in ScriptedFaultyEngine.
        fault_after: refits that succeed before the injected fault fires (once).
        kv_cache_scheme: the quantization config's kv_cache_scheme (None = uncalibrated).
        progress: show a progress bar for long refits.
        trainer: a TrainerModel to use instead of a new reference trainer (e.g. shared by arms).
        engine: a RolloutEngine to use instead of a new reference engine (e.g. a fake).

    Returns:
        app.services.refit.RefitService.
    """
    import attrs

    from adapters.memory.faults import FaultScript
    from adapters.reference.config import preset
    from app.services.refit import RefitService
    from domain.errors import ConfigError
    from domain.refit.session import CommitMode

    plan = plan if plan is not None else build_plan()
    cfg = preset(model)
    if trainer is None:
        from adapters.reference.trainer import ReferenceTrainer

        trainer = ReferenceTrainer.from_seed(cfg, seed)
    try:
        mode = CommitMode.parse(commit_mode)
    except ValueError as err:
        raise ConfigError("commit_mode", str(err)) from None
    if engine is None:
        from adapters.reference.engine import ReferenceEngine

        engine = ReferenceEngine(cfg, plan, commit_mode=mode, kv_cache_scheme=kv_cache_scheme)  # type: ignore[arg-type]
    if inject_fault:
        from adapters.memory.faulty import ScriptedFaultyEngine

        try:
            script = attrs.evolve(FaultScript.parse(inject_fault), after=fault_after)
        except ValueError as err:
            raise ConfigError("--inject-fault", str(err)) from None
        engine = ScriptedFaultyEngine(engine, script)  # type: ignore[arg-type]
    if bucket_megabytes <= 0:
        raise ConfigError("rollout.checkpoint_engine.update_weights_bucket_megabytes", "must be positive")
    return RefitService(trainer, engine, plan, bucket_bytes=int(bucket_megabytes * 2**20), progress=progress)  # type: ignore[arg-type]


def build_refit_service_from_config(config: Mapping[str, object] | None = None, **kwargs: object):
    """A RefitService from a verl-style configuration (rollout.quantization.*, rollout.name,
    rollout.checkpoint_engine.update_weights_bucket_megabytes); other arguments as in
    build_refit_service. Only rollout.name=reference has an engine adapter here.

    Returns:
        app.services.refit.RefitService.
    """
    from app.config import load_config
    from app.services.planning import make_plan
    from domain.errors import ConfigError

    cfg = load_config(config)
    if cfg.rollout.name != "reference" and kwargs.get("engine") is None:
        raise ConfigError(
            "rollout.name", f"{cfg.rollout.name!r} has no engine adapter in this build; use reference "
            "(the embedded engine) or pass an engine"
        )
    plan = make_plan(cfg).plan
    mb = cfg.rollout.checkpoint_engine.update_weights_bucket_megabytes
    return build_refit_service(plan=plan, bucket_megabytes=mb, **kwargs)  # type: ignore[arg-type]


def build_mismatch_probe(service: object, temperature: float = 1.0):
    """A MismatchProbe over a RefitService's trainer and engine.

    Returns:
        app.services.mismatch_probe.MismatchProbe.
    """
    from app.services.mismatch_probe import MismatchProbe

    return MismatchProbe(service.trainer, service.engine, temperature)  # type: ignore[attr-defined]


# --- fused log-prob/entropy forward ---------------------------------------------------------


def build_logprob_service(
    model: object,
    fused_forward: object = None,
    *,
    environ: Mapping[str, str] | None = None,
    chunk_size: int | None = None,
    config: Mapping[str, object] | None = None,
):
    """A LogProbService over a Megatron GPTModel (wrappers allowed) or any TrainerModel.

    A Megatron model with GatedDeltaNet layers also gets packed (THD) GDN input made safe here
    (`apply_packed_gdn`, kernels from `actor.megatron.gdn_kernels` in `config`).

    The fused-forward mode is decided here, once: `fused_forward` (the value of
    `actor.fused_forward`, None when unset) wins; else `VERL_FUSED_USE_OP_HOOK` from the
    environment, read once through `read_environment`; else auto. Later changes to the
    environment change nothing.

    Args:
        model: a Megatron model, or an object that already is a TrainerModel.
        fused_forward: "auto" / "hook" / "legacy" or an alias (see docs/fused-forward.md).
        environ: the environment to read (default: the process environment).
        chunk_size: tokens per chunk of the fused computation (None: sized from the vocabulary).
        config: the configuration (only `actor.megatron.gdn_kernels` is read here).

    Returns:
        app.services.logprob.LogProbService.

    Raises:
        FusedForwardModeError: the value is not a mode (names the key or the variable).
        FusedHookUnavailable: hook required and the model's forward lacks it.
    """
    from app.services.logprob import LogProbService
    from domain.forward.mode import ENV_VAR, FusedForwardRequest

    request = FusedForwardRequest.from_settings(fused_forward, read_environment(environ).get(ENV_VAR))
    if callable(getattr(model, "log_probs", None)) and callable(getattr(model, "named_weights", None)):
        return LogProbService(model, mode="none", source=request.source)  # type: ignore[arg-type]
    from adapters.megatron.trainer_model import MegatronTrainerModel

    apply_packed_gdn(model, config)  # a no-op without GatedDeltaNet layers
    trainer = MegatronTrainerModel.build(model, request.mode, chunk_size=chunk_size)  # type: ignore[arg-type]
    return LogProbService(trainer, mode=trainer.mode.value, source=request.source)


# --- refit doctor: the environment probe ------------------------------------------------------


def build_environment_probe(environ: Mapping[str, str] | None = None, snapshot_file: str | None = None):
    """The EnvironmentProbe `refit doctor` inspects: this machine, or a snapshot saved elsewhere.

    Args:
        environ: the environment to read the honoured variables from (default os.environ).
        snapshot_file: a JSON file written by `refit doctor --json` (its `environment` object is
            used); None probes this machine.

    Returns:
        adapters.system.probe.SystemProbe, or adapters.memory.environment.FixedEnvironmentProbe.
    """
    if snapshot_file is not None:
        import json
        from pathlib import Path

        from adapters.memory.environment import FixedEnvironmentProbe
        from domain.errors import ConfigError

        try:
            data = json.loads(Path(snapshot_file).read_text())
            data = data.get("environment", data) if isinstance(data, dict) else data
            if not isinstance(data, dict):
                raise TypeError(f"it holds a JSON {type(data).__name__}, not an object")
            return FixedEnvironmentProbe.from_dict(data)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
            raise ConfigError("--environment", f"cannot read an environment snapshot from {snapshot_file}: {err}; "
                              "pass the JSON that `refit doctor --json` prints") from None
    from adapters.system.probe import SystemProbe

    return SystemProbe(environ=read_environment(environ))


# --- rollout engine kernels (domain.quant.backend_policy) ------------------------------------------

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def deep_gemm_opt_out(
    engine: str, engine_kwargs: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None
) -> bool:
    """Whether DeepGEMM requests are switched off: `rollout.engine_kwargs.<engine>.use_deep_gemm: false`
    or `VERL_ROLLOUT_USE_DEEP_GEMM=0` (either one restores the engine's automatic selection).

    Args:
        engine: rollout.name ("vllm" or "sglang").
        engine_kwargs: the `rollout.engine_kwargs` section (a mapping of engine -> kwargs), or None.
        environ: the environment (default: this process's), read once here.

    Returns:
        True to opt out. Raises ConfigError naming the key or variable on a value that is not a switch.
    """
    from domain.errors import ConfigError

    section = (engine_kwargs or {}).get(engine) if isinstance(engine_kwargs, Mapping) else None
    value = section.get("use_deep_gemm") if isinstance(section, Mapping) else None
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"rollout.engine_kwargs.{engine}.use_deep_gemm", f"expected true or false, got {value!r}")
    env = read_environment(environ).get("VERL_ROLLOUT_USE_DEEP_GEMM")
    if env is not None and env.strip().lower() not in _ON + _OFF:
        raise ConfigError("VERL_ROLLOUT_USE_DEEP_GEMM", f"expected 1 or 0 (true/false), got {env!r}")
    return value is False or (env is not None and env.strip().lower() in _OFF)


def build_backend_decision(
    engine: str,
    plan: object,
    capability: tuple[int, int] | None = None,
    *,
    engine_kwargs: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
):
    """The kernel backends for a rollout engine (ARCHITECTURE.md section 5), opt-out applied.

    Args:
        engine: rollout.name ("vllm" or "sglang").
        plan: the resolved domain.quant.plan.QuantizationPlan.
        capability: the GPU's compute capability, e.g. torch.cuda.get_device_capability(); None
            skips the capability gates.
        engine_kwargs: the `rollout.engine_kwargs` section, for `use_deep_gemm`.
        environ: the environment, for VERL_ROLLOUT_USE_DEEP_GEMM.

    Returns:
        domain.quant.backend_policy.BackendDecision.
    """
    from domain.quant.backend_policy import decide_backends

    opt_out = deep_gemm_opt_out(engine, engine_kwargs, environ)
    return decide_backends(engine, plan, capability, opt_out=opt_out)  # type: ignore[arg-type]


# --- distributed refit: trainer and engine ranks over torch.distributed ----------------------


def build_distributed_refit(
    world: object,
    rank: int,
    *,
    plan: object | None = None,
    model: str = "tiny-moe",
    seed: int = 0,
    commit_mode: str = "transactional",
    bucket_megabytes: float = 64,
    window: int = 2,
    step_timeout_s: float = 60.0,
    phase_timeout_s: float = 600.0,
    fault: object | None = None,
    restore: str | None = None,
    hang_s: float = 60.0,
):
    """This rank's DistributedRefitService on the embedded reference model, in an initialized
    torch.distributed world (every rank calls it, in the same order: it creates process groups).

    Args:
        world: a domain.refit.sharding.RefitWorld (trainer layout, engine count).
        rank: this process's rank.
        plan: a QuantizationPlan (default build_plan()).
        model: reference model preset; trainer ranks build it from `seed` and keep their slices.
        seed: seed of the trainer's weights.
        commit_mode: the engines' commit mode (`transactional` or `per-layer`).
        bucket_megabytes: bucket capacity, MiB.
        window: buckets in flight (2 = double buffering, 1 = none).
        step_timeout_s: bound on every per-bucket and tensor-parallel wait.
        phase_timeout_s: bound on turns and agreements (they include other ranks' work).
        fault: a adapters.memory.faults.RankFault (tests, demos); an engine rank's bucket / finalize /
            verify failure is a ScriptedFaultyEngine around its engine.
        restore: `replay` or `stale` (None: by commit mode).
        hang_s: how long an injected hang sleeps.

    Returns:
        app.services.distributed_refit.DistributedRefitService.
    """
    from adapters.distributed.torch_dist import TorchDistCollectives
    from adapters.memory.faults import FaultPoint, FaultScript
    from adapters.reference.config import hf_weight_shapes, preset
    from app.services.distributed_refit import DistributedRefitService
    from domain.errors import ConfigError
    from domain.refit.session import CommitMode
    from domain.refit.sharding import TRAINER

    plan = plan if plan is not None else build_plan()
    cfg = preset(model)
    if bucket_megabytes <= 0:
        raise ConfigError("rollout.checkpoint_engine.update_weights_bucket_megabytes", "must be positive")
    bucket_bytes = int(bucket_megabytes * 2**20)
    try:
        mode = CommitMode.parse(commit_mode)
    except ValueError as err:
        raise ConfigError("commit_mode", str(err)) from None
    comm = TorchDistCollectives(world, rank, step_timeout_s, phase_timeout_s, bucket_bytes, window)  # type: ignore[arg-type]
    trainer = engine = None
    if world.role(rank) == TRAINER:  # type: ignore[attr-defined]
        from adapters.distributed.sliced_trainer import SlicedTrainer
        from adapters.reference.trainer import ReferenceTrainer

        trainer = SlicedTrainer(ReferenceTrainer.from_seed(cfg, seed), world.layout, rank)  # type: ignore[attr-defined]
    else:
        from adapters.reference.engine import ReferenceEngine

        engine = ReferenceEngine(cfg, plan, commit_mode=mode)  # type: ignore[arg-type]
        f = fault
        if f is not None and f.rank == rank and not f.hang and f.point in ("bucket", "finalize", "verify"):  # type: ignore[attr-defined]
            from adapters.memory.faulty import ScriptedFaultyEngine

            script = FaultScript(FaultPoint(f.point), f.index, after=f.refit)  # type: ignore[attr-defined]
            engine = ScriptedFaultyEngine(engine, script)  # type: ignore[assignment]
    return DistributedRefitService(
        world, comm, plan, hf_weight_shapes(cfg), trainer=trainer, engine=engine, bucket_bytes=bucket_bytes,  # type: ignore[arg-type]
        window=window, restore=restore, fault=fault, hang_s=hang_s,  # type: ignore[arg-type]
    )


# --- quantization-aware training -------------------------------------------------------------


def build_qat_backend(
    config: Mapping[str, object] | object | None = None,
    *,
    model: object,
    backend: str = "reference",
    numerics: str = "exporter",
    layout: str = "auto",
    model_config: Mapping[str, object] | None = None,
    qat_backend: object | None = None,
):
    """QAT for a built trainer model, per actor.megatron.qat.* and the rollout quantization.

    Resolves the rollout plan on the model's tensors, checks the QAT settings against it
    (mode, Transformer Engine recipe, ignore patterns, first/last BF16 layers), applies the
    backend, and checks every linear and expert layer's effective precision against the plan.

    Args:
        config: a configuration dict, YAML path or app.config Section.
        model: the trainer model (torch / transformers module, Megatron-Core model on one rank,
            or the embedded reference model as adapters.qat_reference.embedded.EmbeddedModule).
        backend: "reference" (pure torch) or "modelopt" (nvidia-modelopt).
        numerics: ModelOpt only: "exporter" (default) or "modelopt" (its own kernels, checked).
        layout: the name mapping: "auto", "torch", "megatron" or "reference".
        model_config: the checkpoint's config.json, when there is one.
        qat_backend: a QatBackend to use instead of building one (tests, custom backends).

    Returns:
        app.services.qat_setup.QatSession (call its refresh() after every optimizer step), or None when
        actor.megatron.qat.enable is false.
    """
    from app.config import Section, load_config
    from app.services.qat_setup import prepare_qat
    from domain.errors import ConfigError

    cfg = config if isinstance(config, Section) else load_config(config)  # type: ignore[arg-type]
    if not cfg.actor.megatron.qat.enable:
        return None
    if qat_backend is None:
        if backend == "reference":
            from adapters.qat_reference.backend import ReferenceQatBackend

            qat_backend = ReferenceQatBackend(layout=layout)
        elif backend == "modelopt":
            from adapters.modelopt.backend import ModelOptQatBackend

            qat_backend = ModelOptQatBackend(numerics=numerics, layout=layout)
        else:
            raise ConfigError("build_qat_backend(backend=...)", f"{backend!r} is not one of reference, modelopt")
    return prepare_qat(cfg, model, qat_backend, layout=layout, model_config=model_config)  # type: ignore[arg-type]


# --- rollout quantization plan and trainer-side export ---------------------------------------


def build_rollout_plan(
    config: Mapping[str, object] | str | None = None,
    overrides: tuple[str, ...] | list[str] = (),
    *,
    model: str | None = None,
):
    """Resolve the rollout quantization of a configuration (and of a checkpoint, when there is one).

    Args:
        config: a configuration dict or YAML path (None: defaults).
        overrides: dotted `KEY=VALUE` overrides.
        model: a checkpoint directory (wins over `model.path`); only its headers are read.

    Returns:
        (app.services.planning.PlanReport, adapters.hf_checkpoint.reader.HfCheckpoint or None). Raises the
        dispatch rule's typed error when the configuration is rejected.
    """
    import json

    from app.config import load_config
    from app.services.planning import make_plan

    extra = [f"model.path={json.dumps(model)}"] if model else []
    cfg = load_config(config, [*overrides, *extra])
    checkpoint = None
    if cfg.model.path:
        from adapters.hf_checkpoint.reader import HfCheckpoint

        checkpoint = HfCheckpoint(cfg.model.path)
    return make_plan(cfg, checkpoint), checkpoint
