"""The rollout engines beyond their refits: the interpreter of a vLLM host, cold starts to compare
with, the kernel backends and their opt-out, and the machine `refit doctor` inspects."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from adapters.profiles import POLICY_ENGINES, backend_decision
from domain.errors import ConfigError

if TYPE_CHECKING:
    from adapters.engine_start import EngineStart
    from adapters.vllm.factory import VllmHost
    from adapters.vllm.launcher import ColdServer
    from app.config_sections import RefitConfig
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
        vllm_host: what starting a vLLM engine needs from this process (`Services.vllm_host`).
    """

    config: RefitConfig
    environ: Mapping[str, str]
    engine_start: Callable[[str], EngineStart]
    vllm_host: Callable[[], VllmHost]

    def configured_python(self) -> tuple[str, str] | None:
        """(key, value) of a vLLM host's interpreter as configured: rollout.engine_kwargs.vllm.python,
        else RL_REFIT_VLLM_PYTHON; None when neither sets it."""
        from adapters.vllm.interpreter import configured_python

        return configured_python(self.config.rollout.engine_kwargs.vllm.python,
                                 self.environ.get("RL_REFIT_VLLM_PYTHON"))

    def vllm_python(self) -> str:
        """The interpreter a disaggregated engine's vLLM server runs with: the configured one, else
        ./.venv-vllm/bin/python (or the one beside this checkout), else this interpreter."""
        from adapters.vllm.interpreter import vllm_python

        return vllm_python(self.configured_python())

    def cold_start(self, directory: str | Path) -> ColdServer:
        """An engine of rollout.name started from a checkpoint directory in its own process, for
        comparisons (ports.engine_inspection, log_probs, placeholders); vllm only."""
        name = self.config.rollout.name
        if name != "vllm":
            raise ConfigError("rollout.name", f"cold starts for comparison are built for vllm only, not {name!r}")
        from adapters.vllm.factory import vllm_cold_start

        return vllm_cold_start(self.config.rollout.engine_kwargs.vllm, self.engine_start("vllm"), self.vllm_host(),
                               str(directory))

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
        """The kernel backends for a rollout engine, opt-out applied
        (docs/engines.md#kernel-backends-backend-policy).

        Args:
            engine: "vllm" or "sglang".
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

    def environment_probe(self, snapshot_file: str | None = None) -> EnvironmentProbe:
        """The EnvironmentProbe `refit doctor` inspects: this machine, or a saved snapshot.

        Args:
            snapshot_file: a JSON file written by `refit doctor --json` (its `environment`
                object is used); None probes this machine.
        """
        if snapshot_file is None:
            from adapters.system.probe import SystemProbe

            python: str | None = self.vllm_python()
            if python == sys.executable and importlib.util.find_spec("vllm") is None:
                python = None  # no vLLM environment to ask
            return SystemProbe(environ=dict(self.environ), vllm_python=python,
                               cpu_emulation=self.config.rollout.engine_kwargs.vllm.cpu_emulation)
        from app.services.doctor import snapshot_probe

        return snapshot_probe(snapshot_file)
