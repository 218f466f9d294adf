"""The vLLM engine, built from its configuration section and the start resolved for a plan: in
this process (colocated) or as a vLLM server of its own (disaggregated, adapters.vllm.launcher), and the cold starts
refits are compared with.

The engine's arguments and environment come from the plan and the backend decision: the
quantization_config travels through `hf_overrides` (vLLM reads it as if config.json carried it),
`quantization` names its method, and the backend decision becomes `linear_backend` /
`moe_backend` (vLLM's KernelConfig) plus the DeepGEMM switches vLLM reads from its environment.
Nothing here reads the environment: the composition root hands over what it read (`EngineHost`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adapters.engine_overrides import check_request, with_quantization_config
from adapters.engine_plugin import EngineHost
from adapters.engine_start import EngineStart, check_commit_mode
from adapters.vllm.config import PYTHON_VAR, VllmEngineConfig
from adapters.vllm.cpu_emulation import ENV_VAR as CPU_EMULATION_ENV
from adapters.vllm.cpu_emulation import parse_mode
from adapters.vllm.engine import VllmRolloutEngine, remove_dirs
from adapters.vllm.interpreter import configured_python, host_python
from domain.errors import ConfigError
from domain.quant import modelopt_layout
from domain.quant.backend_policy import DEEP_GEMM, BackendDecision
from domain.refit.session import CommitMode

if TYPE_CHECKING:
    from adapters.vllm.cold_start import ColdProcess
    from adapters.vllm.launcher import ColdServer


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def engine_workers(engine_args: Mapping[str, Any]) -> int:
    """How many worker processes an engine with these arguments starts (tensor x pipeline parallel)."""
    return int(engine_args.get("tensor_parallel_size") or 1) * int(engine_args.get("pipeline_parallel_size") or 1)


def thread_binding(cpus: Sequence[int], workers: int) -> str:
    """vLLM's CPU thread binding (`VLLM_CPU_OMP_THREADS_BIND`) for `workers` workers on `cpus`: the
    cores split into that many contiguous groups, one per worker, as vLLM reads it (`0|1`,
    `0,1|2,3`). The cores left over by an uneven split go to the last workers.

    Raises ConfigError when there are fewer cores than workers (vLLM would bind two workers to one
    core, or refuse the count).
    """
    cores = sorted(set(cpus))
    if workers < 1 or len(cores) < workers:
        raise ConfigError("rollout.engine_kwargs.vllm.engine_args.tensor_parallel_size",
                          f"{workers} workers need a core each; this process may run on {len(cores)} "
                          f"({','.join(map(str, cores)) or 'none'}): lower tensor_parallel_size or set {THREADS_BIND} "
                          "in rollout.engine_kwargs.vllm.environment")
    size, extra = divmod(len(cores), workers)
    groups, at = [], 0
    for i in range(workers):
        n = size + (1 if i >= workers - extra else 0)
        groups.append(",".join(map(str, cores[at:at + n])))
        at += n
    return "|".join(groups)


def vllm_engine_kwargs(
    quantization_config: Mapping[str, Any] | None,
    decision: BackendDecision,
    *,
    kv_cache_dtype: str = "auto",
    base: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM(...)` / `EngineArgs(...)`.

    Args:
        quantization_config: what the engine is sent
            (adapters.engine_quantization.engine_quantization_config), or None for BF16.
        decision: the backend policy's decision for vLLM.
        kv_cache_dtype: vLLM's `kv_cache_dtype` ("auto", or "fp8" for an FP8 KV cache).
        base: the user's other engine arguments (model, seed, ...), kept as given; an
            `hf_overrides` there is merged (its quantization_config replaced by the plan's).

    Returns:
        The keyword arguments. Raises ConfigError for a decision of another engine or an
        unknown kv_cache_dtype.
    """
    check_request("vllm", "vLLM", decision, kv_cache_dtype, KV_CACHE_DTYPES)
    kwargs = dict(base or {})
    overrides, quantization = with_quantization_config(kwargs.get("hf_overrides") or {}, quantization_config)
    if quantization is not None:
        kwargs["quantization"] = quantization
    if quantization == modelopt_layout.QUANT_METHOD:  # ModelOpt's layout: NVFP4 experts, per-token activations
        kwargs["quantization_config"] = copy.deepcopy(dict(modelopt_layout.PER_TOKEN_OVERRIDE))
    if overrides:
        kwargs["hf_overrides"] = overrides
    else:
        kwargs.pop("hf_overrides", None)
    kwargs["linear_backend"] = decision.linear.backend
    kwargs["moe_backend"] = decision.moe.backend
    kwargs["kv_cache_dtype"] = kv_cache_dtype
    return kwargs


def vllm_environment(decision: BackendDecision, *, colocated: bool, cpu_emulation: str = "auto") -> dict[str, str]:
    """Environment variables vLLM must start with for this decision and deployment shape.

    Args:
        decision: the backend policy's decision for vLLM.
        colocated: the engine runs in the trainer's process (its engine core and worker too:
            `VLLM_ENABLE_V1_MULTIPROCESSING=0`, so buckets reach the worker by reference), or in
            processes of its own (`=1`, vLLM's default; buckets go over a side group).
        cpu_emulation: the CPU emulation plugin's mode (adapters.vllm.cpu_emulation: auto, on,
            off); it acts on vLLM's CPU platform only.

    Returns:
        Name -> value: the multiprocessing switch, vLLM's log stream (stderr), the CPU emulation
        mode, DeepGEMM switches
        when DeepGEMM is requested,
        and `VLLM_USE_DEEP_GEMM_E8M0=0` when E8M0 packing must be off.
    """
    # vLLM logs to stdout by default; stdout belongs to the trainer's program (e.g. --json)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if colocated else "1", "VLLM_LOGGING_STREAM": "ext://sys.stderr",
           CPU_EMULATION_ENV: parse_mode(cpu_emulation)}
    if decision.linear.backend == DEEP_GEMM or decision.moe.backend == DEEP_GEMM:
        env["VLLM_USE_DEEP_GEMM"] = "1"
    if decision.moe.backend == DEEP_GEMM:
        env["VLLM_MOE_USE_DEEP_GEMM"] = "1"
    if decision.deep_gemm_e8m0 is False:
        env["VLLM_USE_DEEP_GEMM_E8M0"] = "0"
    return env


def server_python(section: VllmEngineConfig, host: EngineHost) -> str:
    """The interpreter a vLLM server of rl-refit's runs with: rollout.engine_kwargs.vllm.python, else
    RL_REFIT_VLLM_PYTHON, else a .venv-vllm (adapters.vllm.interpreter); ConfigError naming the
    setting when the configured one cannot be run."""
    return host_python(configured_python(section.python, host.honoured.get(PYTHON_VAR)))


def _base(section: VllmEngineConfig, start: EngineStart) -> dict[str, Any]:
    base = dict(section.engine_args)
    if section.hf_overrides is not None:
        base["hf_overrides"] = dict(section.hf_overrides)
    if start.model_path:
        base.setdefault("model", start.model_path)
    return base


def _environment(section: VllmEngineConfig, start: EngineStart, host: EngineHost, *, colocated: bool,
                 workers: int = 1) -> dict[str, str]:
    env = vllm_environment(start.decision, colocated=colocated, cpu_emulation=section.cpu_emulation)
    given = {k: str(v) for k, v in section.environment.items()}
    if workers > 1 and THREADS_BIND not in given and THREADS_BIND not in host.environ and host.cpus:
        # vLLM's "auto" binds worker N to NUMA node N: with one node, the second worker has none
        env[THREADS_BIND] = thread_binding(host.cpus, workers)
    return {**env, **given}


# vLLM's allowed max_lora_rank values (vllm.config.lora.MaxLoRARanks).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The layers an adapter-mode engine wraps for LoRA: the attention and MLP projections. Not lm_head:
# vLLM wraps the logits processor with it, whose CPU path fails on prompt log-probs (bgmv_shrink
# indexes one row per request, not per prompt position).
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_engine_args(rank: int) -> dict[str, Any]:
    """The engine arguments an adapter-mode engine starts with, unless the user set them: LoRA on
    the projections (LORA_TARGET_MODULES), the smallest max_lora_rank that holds `rank` (0:
    vLLM's default), two adapters served at once (the previous and the new one while a request
    started before the switch finishes) and three held (the served one, a staged one, and one
    more)."""
    args: dict[str, Any] = {"enable_lora": True, "max_loras": 2, "max_cpu_loras": 3,
                            "lora_target_modules": list(LORA_TARGET_MODULES)}
    if rank:
        fits = [r for r in MAX_LORA_RANKS if r >= rank]
        if not fits:
            raise ConfigError("actor.lora.rank", f"{rank} is over vLLM's largest max_lora_rank ({MAX_LORA_RANKS[-1]})")
        args["max_lora_rank"] = fits[0]
    return args


def build_vllm_engine(section: VllmEngineConfig, start: EngineStart, host: EngineHost, *, deployment: str,
                      commit_mode: CommitMode | None = None, lora_rank: int | None = None) -> VllmRolloutEngine:
    """A started vLLM engine configured for `start.plan`.

    Args:
        section: rollout.engine_kwargs.vllm.
        start: the plan, its quantization_config and backend decision, the model.
        host: the starting process's interpreter, environment and embedded model.
        deployment: rollout.deployment, colocated (vLLM in this process) or disaggregated.
        commit_mode: rollout.commit_mode (vLLM commits per layer only).
        lora_rank: serve LoRA adapters of this rank (`actor.lora.sync: adapter`; 0: a rank the
            configuration does not know); None: no LoRA.
    """
    check_commit_mode(commit_mode, CommitMode.PER_LAYER, "vllm")
    base = _base(section, start)
    if lora_rank is not None:
        base = {**lora_engine_args(lora_rank), **base}
    kwargs = vllm_engine_kwargs(start.quantization_config, start.decision, kv_cache_dtype=section.kv_cache_dtype,
                                base=base)
    colocated = deployment == "colocated"
    workers = engine_workers(kwargs)
    if colocated and workers > 1:
        raise ConfigError("rollout.deployment", f"a vLLM engine of {workers} workers (tensor_parallel_size x "
                          "pipeline_parallel_size) runs them in processes of their own, where buckets cannot pass "
                          "by reference: set rollout.deployment=disaggregated")
    owned: tuple[str, ...] = ()
    if "model" not in kwargs:  # the embedded model: its config.json, weights from the first refit
        kwargs["model"] = str(host.embedded_model_dir())
        kwargs.setdefault("load_format", "dummy")
        owned = (kwargs["model"],)
    try:
        return _launch(kwargs, _environment(section, start, host, colocated=colocated, workers=workers), host,
                       section, colocated=colocated, owned=owned)
    except BaseException:  # an engine that did not start closes nothing: remove what was made for it
        remove_dirs(owned)
        raise


def _launch(kwargs: dict[str, Any], env: dict[str, str], host: EngineHost, section: VllmEngineConfig, *,
            colocated: bool, owned: tuple[str, ...]) -> VllmRolloutEngine:
    if colocated:
        from adapters.vllm.client import ExtensionWorkers, LlmGreedy, LlmLogProbs

        host.export_environment(env)  # vLLM reads these when it starts, in this process
        local = ExtensionWorkers.launch(**kwargs)
        return VllmRolloutEngine(local, log_prob_fn=LlmLogProbs(local.llm), greedy_fn=LlmGreedy(local.llm),
                                 owned_dirs=owned)
    from adapters.vllm.attached import Expected, attach
    from adapters.vllm.launcher import start_owned

    # the server a user runs, started on loopback and refitted as an attached one (docs/engines.md)
    control = start_owned(server_python(section, host), kwargs, env={**host.environ, **env},
                          start_timeout_s=float(section.start_timeout_s), owned=owned)
    try:
        expected = Expected(model=str(kwargs["model"]), quantization=kwargs.get("quantization"), scheme=_scheme(kwargs),
                            kv_cache_dtype=section.kv_cache_dtype)
        return attach(control, expected, bucket_bytes=host.bucket_bytes, settings=_attach_settings(section),
                      owned_dirs=owned)
    except BaseException:
        control.close()
        raise


def _scheme(kwargs: Mapping[str, Any]) -> str | None:
    """The quantization scheme of the config an engine with these arguments reads (the plan's, in
    `hf_overrides`), as a server reports its own (adapters.vllm.attached.probe)."""
    from adapters.engine_overrides import quantization_scheme

    return quantization_scheme((kwargs.get("hf_overrides") or {}).get("quantization_config"))


def _attach_settings(section: VllmEngineConfig) -> dict[str, Any]:
    """AttachedWorkers' options from the configuration section."""
    import torch

    # the trainer's tensors are on its GPU when it has one (the transport's `auto` choice reads it)
    return {"transport": section.transport, "pause_mode": section.pause_mode,
            "reset_running_requests": section.reset_running_requests,
            "source_device": "cuda" if torch.cuda.is_available() else "cpu"}


def server_flags(kwargs: Mapping[str, Any]) -> str:
    """The `vllm serve` flags a server needs to serve a plan, as a user types them (its
    quantization method and the quantization_config it reads through hf_overrides)."""
    import json
    import shlex

    flags = []
    if kwargs.get("quantization"):
        flags.append(f"--quantization {kwargs['quantization']}")
    if kwargs.get("hf_overrides"):
        flags.append(f"--hf-overrides {shlex.quote(json.dumps(kwargs['hf_overrides'], separators=(',', ':')))}")
    return " ".join(flags)


def attach_vllm_engine(section: VllmEngineConfig, start: EngineStart, host: EngineHost, url: str) -> VllmRolloutEngine:
    """An engine over the vLLM server at `url`, which the user started (rollout.deployment:
    attached): probed first (adapters.vllm.attached.probe), never stopped by rl-refit."""
    from adapters.vllm.attached import Expected, attach
    from adapters.vllm.controls import HttpControl

    kwargs = vllm_engine_kwargs(start.quantization_config, start.decision, kv_cache_dtype=section.kv_cache_dtype,
                                base=_base(section, start))
    expected = Expected(model=start.model_path or None, quantization=kwargs.get("quantization"),
                        server_flags=server_flags(kwargs), scheme=_scheme(kwargs),
                        kv_cache_dtype=section.kv_cache_dtype)
    control = HttpControl(url, timeout_s=float(section.start_timeout_s) + 600.0, api_key=section.api_key)
    from adapters.vllm.guardian import Guardian

    return attach(control, expected, bucket_bytes=host.bucket_bytes, settings=_attach_settings(section),
                  guard=lambda token: Guardian.start(url, token, section.api_key))


def cold_start_arguments(section: VllmEngineConfig, start: EngineStart, host: EngineHost,
                         directory: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The engine arguments and the vLLM environment (over the host's) of a cold start from a
    checkpoint directory: the configuration's, reading the weights from `directory`."""
    base = {**_base(section, start), "model": str(directory)}
    base.pop("load_format", None)
    kwargs = vllm_engine_kwargs(start.quantization_config, start.decision, kv_cache_dtype=section.kv_cache_dtype,
                                base=base)
    return kwargs, _environment(section, start, host, colocated=False, workers=engine_workers(kwargs))


def vllm_cold_start(section: VllmEngineConfig, start: EngineStart, host: EngineHost,
                    directory: str) -> ColdProcess | ColdServer:
    """vLLM started from a checkpoint directory in processes of its own, whatever the deployment,
    with the configuration's engine arguments: what a refit is compared with. One worker: one
    process with the engine in it (adapters.vllm.cold_start.ColdProcess); several: a server
    (`vllm_cold_server`)."""
    kwargs, env = cold_start_arguments(section, start, host, directory)
    if engine_workers(kwargs) > 1:
        return vllm_cold_server(section, start, host, directory)
    from adapters.vllm.cold_start import ColdProcess

    return ColdProcess.start(server_python(section, host), kwargs, env={**host.environ, **env}, directory=directory,
                             start_timeout_s=float(section.start_timeout_s))


def vllm_cold_server(section: VllmEngineConfig, start: EngineStart, host: EngineHost, directory: str) -> ColdServer:
    """A vLLM server started from a checkpoint directory (without the weight-transfer backend),
    with the configuration's engine arguments."""
    from adapters.vllm.launcher import ColdServer, start_owned

    kwargs, env = cold_start_arguments(section, start, host, directory)
    control = start_owned(server_python(section, host), kwargs, env={**host.environ, **env},
                          start_timeout_s=float(section.start_timeout_s), transfer=False,
                          role=f"the vLLM server cold-started from {directory} (to compare with)")
    return ColdServer(control, Path(directory))
