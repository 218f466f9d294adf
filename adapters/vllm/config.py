"""rollout.engine_kwargs.vllm: the vLLM plugin's own configuration section (adapters.plugins),
declared once, key by key, as every section is (domain.settings.setting); docs/configuration.md's
rows for these keys are generated from it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from domain.errors import ConfigError
from domain.refit.transport_choice import CHOICES
from domain.settings import (
    NoneType,
    _emulation_mode,
    _hf_overrides,
    _positive_seconds,
    _url,
    _urls,
    declare,
    setting,
)

PATH = "rollout.engine_kwargs.vllm"
PYTHON_VAR = "RL_REFIT_VLLM_PYTHON"  # the python of its servers when `python` is unset


@attrs.frozen(kw_only=True)
class VllmEngineConfig:
    """rollout.engine_kwargs.vllm: the vLLM engine's arguments and rl-refit's settings for it."""

    hf_overrides: Mapping[str, Any] | None = setting(
        (dict, str, NoneType), None,
        "vLLM `hf_overrides`; its `quantization_config` wins over the checkpoint's; an explicit null "
        "means BF16",
        check=_hf_overrides, free=True)
    use_deep_gemm: bool | None = setting(
        (bool, NoneType), None,
        "`false` restores vLLM's automatic kernel selection (no DeepGEMM requests); null = the backend "
        "policy")
    kv_cache_dtype: str = setting(
        (str,), "auto",
        "vLLM's `kv_cache_dtype`: auto, fp8, fp8_e4m3, fp8_e5m2",
        choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"))
    engine_args: Mapping[str, Any] = setting(
        (dict,), {},
        "other `vllm.LLM` arguments, passed as given (`model`, `dtype`, `max_model_len`, `enforce_eager`, "
        "`tensor_parallel_size`, ...); the extension, the load format and what the plan decides are set "
        "by rl-refit",
        free=True)
    environment: Mapping[str, Any] = setting(
        (dict,), {},
        "environment variables the vLLM engine starts with (e.g. `VLLM_CPU_KVCACHE_SPACE`); rl-refit sets "
        "`VLLM_ENABLE_V1_MULTIPROCESSING` for the shape and sends vLLM's logs to stderr",
        free=True)
    python: str | None = setting(
        (str, NoneType), None,
        "disaggregated: the Python that runs the vLLM server (vLLM and rl-refit installed in it), and "
        "every cold start; null = `$RL_REFIT_VLLM_PYTHON`, else `.venv-vllm/bin/python` in the working "
        "directory or beside the rl-refit checkout, else this Python; one that is set must exist and be "
        "executable (a name on `PATH` is fine)")
    start_timeout_s: float = setting(
        (int, float), 600,
        "disaggregated: seconds the vLLM server may take to start, until `/health` answers (positive and "
        "finite; vLLM's own engine start bound, `VLLM_ENGINE_READY_TIMEOUT_S`, is 600 too; a server that "
        "exits fails at once; a line on stderr every 30 s says it is still waiting); past it the server and its engine "
        "processes are killed and `EngineProcessError` names the log; each request to a vLLM server, "
        "attached or disaggregated, may take up to this plus 600 s",
        check=_positive_seconds)
    transport: str = setting(
        (str,), "shm",
        "disaggregated and attached vLLM: how each refit's buckets reach the engine's workers: `shm`, a "
        "ring of anonymous shared memory that the trainer writes and every worker copies out of (the "
        "server's workers on the trainer's host, in its network namespace); `gloo`, a process group over "
        "TCP on 127.0.0.1; `nccl`, GPU to GPU over NCCL; `cuda_ipc`, a double buffer on the trainer's GPU "
        "that the workers on its host map once; `auto`, by where the tensors and the workers live "
        "([engines](engines.md#transports))",
        choices=CHOICES)
    cpu_emulation: str = setting(
        (str, bool), "auto",
        "vLLM's CPU platform only: emulate the matmul of the formats this CPU has no vLLM kernel for "
        "(`auto`), of every format (`on`), or of none (`off`); weights, loading and the layerwise reload "
        "stay vLLM's ([engines](engines.md#every-format-on-any-x86-cpu-emulated-matmuls))",
        check=_emulation_mode)
    url: str | None = setting(
        (str, NoneType), None,
        "attached: the vLLM server's base URL (`http://HOST:PORT`), started with dev mode and "
        "`--weight-transfer-config '{\"backend\": \"rl_refit\"}'` ([attach](attach.md)); rl-refit starts "
        "nothing and never stops it",
        check=_url)
    urls: tuple[str, ...] = setting(
        (list, tuple), (),
        "attached: one URL per replica, refitted together, all or nothing (instead of `url`)",
        check=_urls)
    api_key: str | None = setting(
        (str, NoneType), None,
        "attached: the server's `--api-key`, when it has one")
    pause_mode: str = setting(
        (str,), "keep",
        "a vLLM server (attached or disaggregated): how generation pauses around a refit: in-flight "
        "requests freeze and continue after it (`keep`), are dropped (`abort`), or finish first (`wait`)",
        choices=("keep", "abort", "wait"))
    reset_running_requests: bool = setting(
        (bool,), False,
        "a vLLM server (attached or disaggregated): also drop the KV of requests in flight when the refit "
        "ends, so their continuation is computed with the new weights (on-policy)")


    def replicas(self, deployment: str, configured: int) -> int:
        """How many engines a deployment refits: attached, one per URL of `urls` (else
        `configured`); a colocated vLLM owns its process's state, so one only.

        Raises ConfigError naming rollout.replicas for several colocated replicas.
        """
        if deployment == "attached":
            return len(self.urls) or configured
        if configured > 1 and deployment == "colocated":
            raise ConfigError("rollout.replicas", f"{configured} vLLM replicas cannot share the trainer's process "
                              "(vLLM owns its process's state): set rollout.deployment=disaggregated")
        return configured

    def attached_url(self, replica: int) -> str:
        """The URL of an attached replica. Raises ConfigError naming the key when none is given."""
        urls = self.urls or ((self.url,) if self.url else ())
        if not urls:
            raise ConfigError(f"{PATH}.url", "rollout.deployment=attached refits a server you started: give its URL "
                              "(http://HOST:PORT), or urls for several replicas")
        return urls[replica]

    def ring_copies_buckets(self) -> bool:
        """Whether a server's transport copies each tensor out of the trainer's own memory (the
        shared-memory ring, CUDA IPC): buckets then travel by reference, unpacked."""
        return self.transport in ("shm", "cuda_ipc", "auto")


declare(VllmEngineConfig, f"{PATH}.")
