"""The rollout engines beyond their refits: cold starts to compare with, the kernel backends and
their opt-out, and the machine `refit doctor` inspects; each asked of the engine's plugin."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from adapters.plugins import PLUGINS, plugin_for
from adapters.profiles import POLICY_ENGINES, backend_decision
from domain.errors import ConfigError

if TYPE_CHECKING:
    from adapters.engine_plugin import EngineHost
    from adapters.engine_start import EngineStart
    from app.config_sections import RefitConfig
    from app.services.engine_demo import ColdStart
    from domain.quant.backend_policy import BackendDecision
    from domain.quant.plan import QuantizationPlan
    from ports.environment_probe import EnvironmentProbe

_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@attrs.frozen
class EngineWiring:
    """`Services.engines`: what the engine of `rollout.name` needs besides the refit.

    Attributes:
        config: the validated configuration.
        environ: the honoured environment variables, as the composition root read them.
        engine_start: what the real engine of a name starts with for the configuration's plan
            (`Services.engine_start`).
        engine_host: what this process offers the engines it builds (`Services.engine_host`).
    """

    config: RefitConfig
    environ: Mapping[str, str]
    engine_start: Callable[[str], EngineStart]
    engine_host: Callable[[], EngineHost]

    def server_python(self, engine: str | None = None) -> str:
        """The interpreter a server of the engine (default rollout.name) runs with, as its plugin
        resolves it (its `server_python`, docs/engines.md). Raises ConfigError naming rollout.name for an engine that
        starts no server."""
        plugin = plugin_for(engine or self.config.rollout.name)
        if plugin.server_python is None:
            raise ConfigError("rollout.name", f"{plugin.name} starts no server of its own")
        return plugin.server_python(self.config.rollout.engine_kwargs.engine(plugin.name), self.engine_host())

    def cold_start(self, directory: str | Path) -> ColdStart:
        """An engine of rollout.name started cold from a checkpoint directory in a process of its
        own, for comparisons (ports.engine_inspection, log_probs, placeholders): its plugin's
        `cold_start`. Raises ConfigError naming rollout.name for an engine that has none."""
        name = self.config.rollout.name
        plugin = plugin_for(name)
        if plugin.cold_start is None:
            raise ConfigError("rollout.name", f"cold starts for comparison are built for "
                              f"{', '.join(p.name for p in PLUGINS.values() if p.cold_start)} only, not {name!r}")
        return plugin.cold_start(self.config.rollout.engine_kwargs.engine(name), self.engine_start(name),
                                 self.engine_host(), str(directory))

    def deep_gemm_opt_out(self, engine: str, environ: Mapping[str, str] | None = None) -> bool:
        """Whether DeepGEMM requests are off: `rollout.engine_kwargs.<engine>.use_deep_gemm: false`
        or `VERL_ROLLOUT_USE_DEEP_GEMM=0` (either restores the engine's automatic selection).

        Args:
            engine: an engine with a backend policy (adapters.profiles.POLICY_ENGINES).
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
        """The kernel backends for a rollout engine, opt-out applied
        (docs/engines.md#kernel-backends-backend-policy).

        Args:
            engine: an engine with a backend policy (adapters.profiles.POLICY_ENGINES).
            plan: the resolved plan.
            capability: the GPU's compute capability; None skips the capability gates.
        """
        return backend_decision(engine, plan, capability, opt_out=self.deep_gemm_opt_out(engine))

    def planned_backends(self, engine: str, plan: QuantizationPlan) -> BackendDecision | None:
        """`backend_decision` without a GPU to gate on (`refit plan`); None for an engine that has
        no kernel to choose (the embedded engine computes in pure torch)."""
        if engine not in POLICY_ENGINES:
            return None
        return self.backend_decision(engine, plan)

    def environment_probe(self, snapshot_file: str | None = None, *,
                          notify: Callable[[str], None] | None = None) -> EnvironmentProbe:
        """The EnvironmentProbe `refit doctor` inspects: this machine, or a saved snapshot.

        Args:
            snapshot_file: a JSON file written by `refit doctor --json` (its `environment`
                object is used); None probes this machine.
            notify: told what a probe of this machine waits for, before a step that takes seconds.
        """
        if snapshot_file is None:
            from adapters.system.probe import SystemProbe

            host, engine_kwargs = self.engine_host(), self.config.rollout.engine_kwargs
            arguments = {k: v for p in PLUGINS.values() if p.probe is not None
                         for k, v in p.probe(engine_kwargs.engine(p.name), host).items()}
            return SystemProbe(environ=dict(self.environ), notify=notify, **arguments)
        from app.services.doctor import snapshot_probe

        return snapshot_probe(snapshot_file)
