"""`refit doctor`: what of the support matrix works on this machine, and why the rest does not.

`diagnose(snapshot, config)` is pure: it reads an EnvironmentSnapshot (from any
EnvironmentProbe: this machine, or a fake one in tests) and an optional configuration, and
returns a DoctorReport: the machine checks (app/services/doctor_checks.py), the fused-forward mode
`auto` would pick, and, for a configuration, whether its engine, presets, QAT and fused-forward
settings can run here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from adapters.plugins import PLUGINS
from adapters.profiles import POLICY_ENGINES, backend_decision
from app.config_sections import RefitConfig
from app.services.doctor_checks import (
    MEGATRON_NATIVE_HOOK,
    Check,
    Reason,
    Status,
    environment_checks,
    package_check,
    transport_checks,
)
from domain.environment import EnvironmentSnapshot, version_at_least
from domain.errors import ConfigError, FusedHookUnavailable, RefitError
from domain.forward.mode import (
    ENV_VAR,
    FusedForwardMode,
    FusedForwardRequest,
    select_fused_forward_mode,
)

if TYPE_CHECKING:
    from adapters.memory.environment import FixedEnvironmentProbe


@attrs.frozen
class FusedForwardDecision:
    """The fused log-prob forward's mode as the model build would pick it on this machine.

    Attributes:
        requested: auto, hook or legacy.
        source: where the request came from (actor.fused_forward, VERL_FUSED_USE_OP_HOOK, default).
        mode: hook or legacy; None when it cannot be decided (no megatron-core, or a hook
            requirement this Megatron-Core cannot meet).
        detail: why, in words.
    """

    requested: str
    source: str
    mode: str | None
    detail: str
    reason: Reason | None = None

    def to_dict(self) -> dict[str, object]:
        return {"requested": self.requested, "source": self.source, "mode": self.mode, "detail": self.detail,
                "reason": self.reason.value if self.reason else None}


@attrs.frozen
class DoctorReport:
    """Everything `refit doctor` prints.

    Attributes:
        environment: the machine's snapshot.
        checks: machine checks, then configuration checks, then the fused forward's.
        fused_forward: the mode `auto` (or the configured mode) resolves to here.
        config_given: whether a configuration was checked.
    """

    environment: EnvironmentSnapshot
    checks: tuple[Check, ...]
    fused_forward: FusedForwardDecision
    config_given: bool = False

    @property
    def config_ok(self) -> bool | None:
        """None without a configuration; else True when no config check is an error."""
        if not self.config_given:
            return None
        return not any(c.status is Status.ERROR for c in self.checks)

    def to_dict(self) -> dict[str, object]:
        return {"environment": self.environment.to_dict(), "checks": [c.to_dict() for c in self.checks],
                "fused_forward": self.fused_forward.to_dict(), "config_ok": self.config_ok}


def fused_forward_decision(env: EnvironmentSnapshot, config_value: object = None) -> FusedForwardDecision:
    """The mode the Megatron adapter's `resolve_fused_forward` would pick for a model built here.

    The hook is judged available when the installed Megatron-Core is 0.18 or newer (the release
    whose GPTModel.forward takes `output_processor` and `output_processor_context`); the model
    build itself inspects the real forward's signature.

    Args:
        env: the snapshot (its megatron-core version and VERL_FUSED_USE_OP_HOOK).
        config_value: `actor.fused_forward` from the configuration (None when unset).

    Returns:
        The decision; a bad value gives mode None with the error's message.
    """
    try:
        request = FusedForwardRequest.from_settings(config_value, env.environ.get(ENV_VAR))
    except RefitError as err:
        return FusedForwardDecision(str(config_value), "invalid", None, f"{type(err).__name__}: {err}", Reason.CONFIG)
    requested, source = request.mode.value, request.source
    version = env.version("megatron-core")
    if version is None:
        return FusedForwardDecision(requested, source, None, "megatron-core is not installed: no Megatron model "
                                    "to run the fused forward on (the reference trainer computes log-probs itself)",
                                    Reason.PACKAGE_MISSING)
    hook = version_at_least(version, MEGATRON_NATIVE_HOOK)
    try:
        mode = select_fused_forward_mode(request.mode, hook_available=hook, megatron_version=version)
    except FusedHookUnavailable as err:
        return FusedForwardDecision(requested, source, None, f"FusedHookUnavailable: {err}", Reason.VERSION_TOO_OLD)
    if mode is FusedForwardMode.HOOK:
        why = f"Megatron-Core {version} has the native output_processor hook"
    elif request.mode is FusedForwardMode.LEGACY:
        why = f"legacy requested by {source}: GPTModel.forward is patched"
    else:
        why = f"Megatron-Core {version} < 0.18 has no output_processor hook: GPTModel.forward is patched"
    return FusedForwardDecision(requested, source, mode.value, why)


def _engine_check(env: EnvironmentSnapshot, engine: str) -> Check:
    plugin = PLUGINS.get(engine)
    if plugin is not None and plugin.embedded:
        return Check("config", "rollout.name", Status.OK, f"{engine}: the embedded engine runs here")
    if plugin is None or plugin.build is None or engine not in POLICY_ENGINES:
        built = ", ".join(p.name for p in PLUGINS.values() if p.build is not None)
        return Check("config", "rollout.name", Status.ERROR, f"{engine}: rl-refit has no engine adapter for it",
                     Reason.NOT_SUPPORTED, f"use one of {built}")
    found = package_check(env, "config", engine, f"rollout.name={engine}", f"pip install -e '.[{engine}]' (on a GPU machine)")
    if found.status is not Status.OK:
        return attrs.evolve(found, name="rollout.name", status=Status.ERROR)
    if not env.gpus:
        return Check("config", "rollout.name", Status.ERROR, f"{engine} {env.version(engine)} is installed but "
                     "needs a CUDA GPU and none is visible", Reason.NO_GPU, "run on a GPU machine")
    return Check("config", "rollout.name", Status.OK, f"{engine} {env.version(engine)}")


def _strategy_check(env: EnvironmentSnapshot, strategy: str) -> Check:
    """actor.strategy: the trainer adapter the configuration names, and whether it runs here."""
    key = "actor.strategy"
    if strategy == "reference":
        return Check("config", key, Status.OK, "reference: the embedded trainer runs here")
    if strategy != "megatron":
        return Check("config", key, Status.ERROR, f"{strategy}: rl-refit has no trainer adapter for it",
                     Reason.NOT_SUPPORTED, "use megatron (or reference, the embedded model), or pass a TrainerModel "
                     "of your own to bootstrap(config, trainer=...)")
    found = package_check(env, "config", "megatron-core", "the Megatron trainer adapter", "pip install --no-deps megatron-core "
                          "and pip install -e '.[megatron]'")
    return attrs.evolve(found, name=key, status=Status.OK if found.status is Status.OK else Status.ERROR)


def _sync_backend_check(env: EnvironmentSnapshot, backend: str) -> Check:
    """rollout.checkpoint_engine.backend: the weight-sync transport, judged like the transport rows."""
    key = "rollout.checkpoint_engine.backend"
    if backend != "nccl":
        return Check("config", key, Status.OK, f"{backend}: needs no GPU, runs here")
    nccl = next(c for c in transport_checks(env) if c.name == "nccl")
    if nccl.status is Status.OK:
        return attrs.evolve(nccl, area="config", name=key)
    return attrs.evolve(nccl, area="config", name=key, status=Status.ERROR, detail=f"nccl: {nccl.detail}")


def _kernel_check(env: EnvironmentSnapshot, engine: str, plan: Any, opt_out: bool) -> Check:
    if env.capability is None:
        return Check("config", "kernels", Status.ERROR, f"{engine} serving {plan.linear.name}/{plan.moe.name} needs "
                     "a GPU; none is visible", Reason.NO_GPU, "run on a GPU machine")
    try:
        decision = backend_decision(engine, plan, env.capability, opt_out=opt_out)
    except RefitError as err:
        return Check("config", "kernels", Status.ERROR, f"{type(err).__name__}: {err}", Reason.GPU_TOO_OLD,
                     "use a newer GPU or the presets the message names")
    return Check("config", "kernels", Status.OK, f"linear: {decision.linear.backend}, moe: {decision.moe.backend}; "
                 + "; ".join(decision.notes))


def config_checks(env: EnvironmentSnapshot, cfg: RefitConfig, *, deep_gemm_opt_out: bool = False) -> list[Check]:
    """Can this configuration run here? A loaded configuration in, checks out."""
    from app.services.planning import make_plan

    out = []
    try:
        report = make_plan(cfg)
    except RefitError as err:
        return [Check("config", "plan", Status.ERROR, f"{type(err).__name__}: {err}", Reason.CONFIG,
                      "see docs/errors.md for this error; `refit plan` shows every decision")]
    plan = report.plan
    out.append(Check("config", "plan", Status.OK, f"layout {report.resolution.layout}: linear {plan.linear.name}, "
                     f"moe {plan.moe.name} (per-tensor rules need a model: `refit plan --model DIR`)"))
    engine = report.engine
    out.append(_engine_check(env, engine))
    out.append(_strategy_check(env, cfg.actor.strategy))
    out.append(_sync_backend_check(env, cfg.rollout.checkpoint_engine.backend))
    if engine in POLICY_ENGINES and plan.is_quantized:
        out.append(_kernel_check(env, engine, plan, deep_gemm_opt_out))
    if cfg.actor.megatron.qat.enable:
        out.append(Check("config", "actor.megatron.qat", Status.OK, f"QAT {cfg.actor.megatron.qat.mode}: built-in "
                         "fake quantization runs here"))
    return out


def diagnose(
    env: EnvironmentSnapshot, config: RefitConfig | None = None, *, deep_gemm_opt_out: bool = False
) -> DoctorReport:
    """The doctor's report for one machine and, optionally, one configuration.

    Args:
        env: the machine (EnvironmentProbe.snapshot()).
        config: a loaded configuration (app.config.load_config), or None.
        deep_gemm_opt_out: DeepGEMM requests switched off (the composition root's
            `deep_gemm_opt_out`, from the configuration and VERL_ROLLOUT_USE_DEEP_GEMM).

    Returns:
        The DoctorReport: machine checks, then config checks, and the fused-forward decision.
    """
    checks = environment_checks(env)
    fused_value = None
    if config is not None:
        checks += config_checks(env, config, deep_gemm_opt_out=deep_gemm_opt_out)
        fused_value = config.actor.fused_forward
    fused = fused_forward_decision(env, fused_value)
    checks.append(_fused_check(fused))
    return DoctorReport(env, tuple(checks), fused, config is not None)


def _fused_check(fused: FusedForwardDecision) -> Check:
    text = f"requested {fused.requested} ({fused.source}) -> {fused.mode or 'none'}: {fused.detail}"
    if fused.mode is not None:
        return Check("trainer", "fused forward", Status.OK, text)
    if fused.reason is Reason.PACKAGE_MISSING:
        return Check("trainer", "fused forward", Status.UNAVAILABLE, text, fused.reason, "pip install -e '.[megatron]'")
    fix = (f"set actor.fused_forward (or {ENV_VAR}) to auto or legacy, or upgrade megatron-core to 0.18+"
           if fused.reason is Reason.VERSION_TOO_OLD else "use auto, hook or legacy (see docs/configuration.md)")
    return Check("trainer", "fused forward", Status.ERROR, text, fused.reason, fix)


def snapshot_probe(snapshot_file: str) -> FixedEnvironmentProbe:
    """The machine a saved `refit doctor --json` output describes (its `environment` object).

    Raises:
        ConfigError: naming `--environment` when the file cannot be read as such a snapshot.
    """
    import json

    from adapters.memory.environment import FixedEnvironmentProbe
    from adapters.system.files import read_regular

    try:
        data = json.loads(read_regular(snapshot_file).decode("utf-8"))
        data = data.get("environment", data) if isinstance(data, dict) else data
        if not isinstance(data, dict):
            raise TypeError(f"it holds a JSON {type(data).__name__}, not an object")
        return FixedEnvironmentProbe.from_dict(data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else err
        raise ConfigError("--environment", f"cannot read an environment snapshot from {snapshot_file}: {reason}; "
                          "pass the JSON that `refit doctor --json` prints") from None
