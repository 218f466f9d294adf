"""The vLLM engine, built from its configuration section and the start resolved for a plan: in
this process (colocated) or in an engine host of its own (disaggregated), and the cold starts
refits are compared with.

Nothing here reads the environment: the composition root hands over what it read (`VllmHost`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from adapters.engine_start import EngineStart, check_commit_mode
from adapters.vllm.engine import VllmRolloutEngine
from adapters.vllm.engine_args import vllm_engine_kwargs, vllm_environment
from domain.refit.session import CommitMode

if TYPE_CHECKING:
    from adapters.vllm.remote import ColdEngine


class VllmSettings(Protocol):
    """rollout.engine_kwargs.vllm as the factory reads it (app.config_sections.VllmEngineConfig)."""

    @property
    def hf_overrides(self) -> Mapping[str, Any] | None: ...

    @property
    def kv_cache_dtype(self) -> str: ...

    @property
    def engine_args(self) -> Mapping[str, Any]: ...

    @property
    def environment(self) -> Mapping[str, Any]: ...

    @property
    def start_timeout_s(self) -> float: ...

    @property
    def cpu_emulation(self) -> str: ...


@attrs.frozen
class VllmHost:
    """What starting vLLM needs from the process that starts it.

    Attributes:
        python: the engine host's interpreter (called only when a host starts; it may raise
            ConfigError naming the setting).
        environ: this process's environment, which an engine host inherits.
        export_environment: sets variables in this process (colocated: vLLM reads them as it starts).
        embedded_model_dir: a directory with the embedded model's config.json (no model.path).
        bucket_bytes: the refit's bucket size (the host's side group allocates it).
    """

    python: Callable[[], str]
    environ: Mapping[str, str]
    export_environment: Callable[[Mapping[str, str]], None]
    embedded_model_dir: Callable[[], Path]
    bucket_bytes: int


def _base(section: VllmSettings, start: EngineStart) -> dict[str, Any]:
    base = dict(section.engine_args)
    if section.hf_overrides is not None:
        base["hf_overrides"] = dict(section.hf_overrides)
    if start.model_path:
        base.setdefault("model", start.model_path)
    return base


def _environment(section: VllmSettings, start: EngineStart, *, colocated: bool) -> dict[str, str]:
    return {**vllm_environment(start.decision, colocated=colocated, cpu_emulation=section.cpu_emulation),
            **{k: str(v) for k, v in section.environment.items()}}


def build_vllm_engine(section: VllmSettings, start: EngineStart, host: VllmHost, *, deployment: str,
                      commit_mode: CommitMode | None = None) -> VllmRolloutEngine:
    """A started vLLM engine configured for `start.plan`.

    Args:
        section: rollout.engine_kwargs.vllm.
        start: the plan, its quantization_config and backend decision, the model.
        host: the starting process's interpreter, environment and embedded model.
        deployment: rollout.deployment, colocated (vLLM in this process) or disaggregated.
        commit_mode: rollout.commit_mode (vLLM commits per layer only).
    """
    check_commit_mode(commit_mode, CommitMode.PER_LAYER, "vllm")
    kwargs = vllm_engine_kwargs(start.quantization_config, start.decision, kv_cache_dtype=section.kv_cache_dtype,
                                base=_base(section, start))
    owned: tuple[str, ...] = ()
    if "model" not in kwargs:  # the embedded model: its config.json, weights from the first refit
        kwargs["model"] = str(host.embedded_model_dir())
        kwargs.setdefault("load_format", "dummy")
        owned = (kwargs["model"],)
    colocated = deployment == "colocated"
    env = _environment(section, start, colocated=colocated)
    if colocated:
        from adapters.vllm.client import ExtensionWorkers, LlmGreedy, LlmLogProbs

        host.export_environment(env)  # vLLM reads these when it starts, in this process
        local = ExtensionWorkers.launch(**kwargs)
        return VllmRolloutEngine(local, log_prob_fn=LlmLogProbs(local.llm), greedy_fn=LlmGreedy(local.llm),
                                 owned_dirs=owned)
    from adapters.vllm.remote import EngineProcess, RemoteGreedy, RemoteLogProbs, RemoteWorkers

    process = EngineProcess.start(host.python(), kwargs, env={**host.environ, **env},
                                  start_timeout_s=float(section.start_timeout_s))
    return VllmRolloutEngine(RemoteWorkers(process, host.bucket_bytes), log_prob_fn=RemoteLogProbs(process),
                             greedy_fn=RemoteGreedy(process), owned_dirs=owned)


def vllm_cold_start(section: VllmSettings, start: EngineStart, host: VllmHost, directory: str) -> ColdEngine:
    """A vLLM engine host started from a checkpoint directory (its own process, whatever the
    deployment), with the configuration's engine arguments."""
    from adapters.vllm.remote import ColdEngine, EngineProcess

    base = {**_base(section, start), "model": str(directory)}
    base.pop("load_format", None)
    kwargs = vllm_engine_kwargs(start.quantization_config, start.decision, kv_cache_dtype=section.kv_cache_dtype,
                                base=base)
    env = {**host.environ, **_environment(section, start, colocated=False)}
    return ColdEngine(EngineProcess.start(host.python(), kwargs, env=env, start_timeout_s=float(section.start_timeout_s)))
