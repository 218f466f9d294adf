"""vLLM engine arguments and environment for a resolved plan and backend decision.

The quantization_config travels through `hf_overrides` (vLLM reads it as if config.json carried
it), `quantization` names its method, and the backend decision becomes `linear_backend` /
`moe_backend` (vLLM's KernelConfig) plus the DeepGEMM switches vLLM reads from its environment.
The caller applies the environment before vLLM starts; nothing here reads or writes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adapters.engine_overrides import check_request, with_quantization_config
from adapters.vllm.cpu_emulation import ENV_VAR as CPU_EMULATION_ENV
from adapters.vllm.cpu_emulation import parse_mode
from domain.quant.backend_policy import DEEP_GEMM, BackendDecision

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# rl-refit's worker extension (`worker_extension_cls`): the receiving end of a refit in each worker.
EXTENSION = "adapters.vllm.extension.RefitWorkerExtension"


def vllm_engine_kwargs(
    quantization_config: Mapping[str, Any] | None,
    decision: BackendDecision,
    *,
    kv_cache_dtype: str = "auto",
    base: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM(...)` / `EngineArgs(...)`.

    Args:
        quantization_config: what the engine is sent (adapters.compressed_tensors
            engine_quantization_config), or None for BF16.
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
