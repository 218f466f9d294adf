"""How rl-refit reaches a vLLM engine it did not start: one control seam, four implementations.

`EngineControl` is what the attached engine (adapters.vllm.attached) needs from a running vLLM:
its weight-transfer calls (the `VLLMWeightSyncClient` surface vLLM defines), rl-refit's worker
calls (`collective_rpc` of the worker extension's `rl_refit_*` methods), the generation bracket
(pause, resume, prefix-cache reset, weight version) and the probe's prompt log-probs and greedy
tokens. Bucket data never takes it: it goes over rl-refit's own transport.

| implementation | reaches | notes |
|---|---|---|
| `HttpControl(url)` | a server (`vllm serve`, `python -m vllm.entrypoints.openai.api_server`) | needs `VLLM_SERVER_DEV_MODE=1` (the RL routes and `/collective_rpc`) |
| `AsyncLlmControl(async_llm, loop)` | an `AsyncLLM` object (verl, NeMo-RL) | its coroutines run on its own event loop; the caller's thread waits, never that loop |
| `LlmControl(llm)` | an offline `vllm.LLM` | synchronous; it generates only when asked, so pausing is nothing |
| `RayControl(actor)` | a Ray actor that exposes vLLM's methods (`collective_rpc`, ...) | Ray is an optional extra |

Each raises what the engine said as rl-refit's typed errors (ServerUnreachable, ServerMismatch,
or the worker's own error class through the worker protocol).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

import attrs
import torch

from adapters.system.http import JsonServer
from adapters.vllm.lora import SERVED_NAME, STAGED_PREFIX, LoraServing, lora_request
from adapters.vllm.protocol import from_json_safe, json_safe
from domain.errors import AdapterUpdateFailed, EngineUpdateFailed, ServerMismatch, ServerUnreachable

PAUSE_MODES = ("keep", "abort", "wait")


class EngineControl(Protocol):
    """A running vLLM engine's control plane (see the module's docstring)."""

    @property
    def where(self) -> str:
        """The engine, in words, for messages (its URL, "an AsyncLLM", ...)."""
        ...

    @property
    def same_host(self) -> bool:
        """The engine's workers run on this host (a ring or CUDA IPC can reach them)."""
        ...

    def collective_rpc(self, method: str, request: dict[str, Any]) -> list[Any]:
        """Every worker's answer to the worker-extension method `method` with `request`."""
        ...

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...

    def pause(self, mode: str) -> None:
        """Stop scheduling (`keep`: freeze in-flight requests; `abort`; `wait`: let them finish)."""
        ...

    def resume(self) -> None: ...

    def reset_prefix_cache(self, reset_running_requests: bool) -> bool:
        """Drop the prefix cache (KV computed with older weights); True when it was dropped."""
        ...

    def set_weight_version(self, version: str) -> None: ...

    def weight_version(self) -> str | None: ...

    def log_probs(self, input_ids: torch.Tensor, temperature: float = 1.0,
                  lora: LoraServing | None = None) -> torch.Tensor:
        """log p(token_t | tokens_<t) for t >= 1, one request per row ([B, T-1], float32), with
        the LoRA adapter `lora` (None: the base model)."""
        ...

    def greedy(self, prompts: list[list[int]], max_tokens: int, lora: LoraServing | None = None) -> list[list[int]]:
        """Greedy continuations, one request at a time (with the LoRA adapter `lora`)."""
        ...

    def close(self) -> None:
        """Let go of the engine (it keeps running)."""
        ...


# --- HTTP ---------------------------------------------------------------------------------------


@attrs.define
class HttpControl:
    """A vLLM server over HTTP (dev mode: `VLLM_SERVER_DEV_MODE=1`).

    Attributes:
        url: the server's base URL (`http://127.0.0.1:8000`).
        timeout_s: bound on each request (a weight update's included).
        api_key: the server's `--api-key`, when it has one.
    """

    url: str = attrs.field(converter=lambda u: str(u).rstrip("/"))
    timeout_s: float = 600.0
    api_key: str | None = None
    _model: str | None = attrs.field(init=False, default=None)
    _loras: dict[int, str] = attrs.field(init=False, factory=dict)  # adapter id -> the name the server serves it by
    lora_root: Path | None = attrs.field(init=False, default=None)  # where staged adapters are written (made on use)

    @property
    def where(self) -> str:
        return f"the vLLM server at {self.url}"

    @property
    def same_host(self) -> bool:
        host = urllib.parse.urlsplit(self.url).hostname or ""
        return host in ("localhost", "::1") or host.startswith("127.")

    # --- requests ---

    def request(self, method: str, path: str, body: Any = None, *, query: dict[str, Any] | None = None,
                timeout_s: float | None = None) -> Any:
        """The server's JSON answer to `method path` (None for an empty body); one typed line for
        every way it fails (adapters.system.http.JsonServer)."""
        server = JsonServer(self.url, self.where, "rollout.engine_kwargs.vllm.url", self.api_key,
                            "its --api-key: rollout.engine_kwargs.vllm.api_key",
                            "start it with VLLM_SERVER_DEV_MODE=1 (the RL routes and /collective_rpc exist only in "
                            "dev mode)", self.timeout_s)
        return server.request(method, path, body, query=query, timeout_s=timeout_s)[1]

    def health(self) -> bool:
        """True when `/health` answers 200."""
        try:
            self.request("GET", "/health", timeout_s=10.0)
        except (ServerUnreachable, EngineUpdateFailed, ServerMismatch):
            return False
        return True

    def served_model(self) -> str:
        """The model the server serves (its first `/v1/models` entry)."""
        if self._model is None:
            models = self.request("GET", "/v1/models")
            data = (models or {}).get("data") or []
            if not data:
                raise ServerMismatch(f"{self.where} serves no model (/v1/models is empty)")
            self._model = str(data[0]["id"])
        return self._model

    # --- EngineControl ---

    def collective_rpc(self, method: str, request: dict[str, Any]) -> list[Any]:
        # vLLM's HTTP collective_rpc passes string arguments only: the request travels as JSON text,
        # bytes base64-encoded either way (adapters.vllm.protocol.json_safe)
        answer = self.request("POST", "/collective_rpc", {"method": method, "args": [json.dumps(json_safe(request))]})
        results = (answer or {}).get("results")
        if not isinstance(results, list):
            raise ServerMismatch(f"{self.where} answered collective_rpc({method}) with {answer!r}")
        return [from_json_safe(r) for r in results]

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.request("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.request("POST", "/start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.request("POST", "/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.request("POST", "/finish_weight_update",
                     None if weight_version is None else {"weight_version": weight_version})

    def pause(self, mode: str) -> None:
        self.request("POST", "/pause", query={"mode": mode})

    def resume(self) -> None:
        self.request("POST", "/resume")

    def reset_prefix_cache(self, reset_running_requests: bool) -> bool:
        answer = self.request("POST", "/reset_prefix_cache", query={"reset_running_requests": reset_running_requests})
        return bool((answer or {}).get("success", True))

    def set_weight_version(self, version: str) -> None:
        self.request("POST", "/update_weight_version", {"new_version": version})

    def weight_version(self) -> str | None:
        answer = self.request("GET", "/weight_info")
        value = (answer or {}).get("weight_version")
        return None if value is None else str(value)

    def is_paused(self) -> bool:
        return bool((self.request("GET", "/is_paused") or {}).get("is_paused"))

    def log_probs(self, input_ids: torch.Tensor, temperature: float = 1.0,
                  lora: LoraServing | None = None) -> torch.Tensor:
        model = self._model_for(lora)
        rows = []
        for row in input_ids.tolist():
            answer = self.request("POST", "/v1/completions", {
                "model": model, "prompt": row, "max_tokens": 1, "temperature": temperature, "prompt_logprobs": 0})
            per_pos = answer["choices"][0]["prompt_logprobs"][1:]  # position 0 has none
            rows.append([float(pos[str(tok)]["logprob"]) for tok, pos in zip(row[1:], per_pos, strict=True)])
        return torch.tensor(rows, dtype=torch.float32)

    def greedy(self, prompts: list[list[int]], max_tokens: int, lora: LoraServing | None = None) -> list[list[int]]:
        model = self._model_for(lora)
        out = []
        for prompt in prompts:
            answer = self.request("POST", "/v1/completions", {
                "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True})
            out.append([int(t) for t in answer["choices"][0]["token_ids"]])
        return out

    # --- LoRA adapters: through vLLM's own routes (docs/lora.md) ---

    def stage_lora(self, adapter_id: int, config: Mapping[str, Any], tensors: bytes) -> int:
        """Write the adapter as PEFT writes it into a private directory on this host and have the
        server load it through `/v1/load_lora_adapter`, served as `rl-refit-<id>`; returns the
        bytes written. AdapterUpdateFailed when the server refuses it."""
        if self.lora_root is None:
            self.lora_root = Path(tempfile.mkdtemp(prefix="rl-refit-lora-"))  # 0700
        directory = self.lora_root / str(adapter_id)
        directory.mkdir(mode=0o700, parents=True)
        (directory / "adapter_model.safetensors").write_bytes(tensors)
        (directory / "adapter_config.json").write_text(json.dumps(dict(config)))
        self._load_lora(adapter_id, f"{SERVED_NAME}-{adapter_id}", str(directory))
        return len(tensors)

    def drop_lora(self, adapter_id: int) -> None:
        """Unload an adapter this control loaded (nothing for another id)."""
        name = self._loras.pop(adapter_id, None)
        if name is not None:
            self.request("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        if self.lora_root is not None:
            shutil.rmtree(self.lora_root / str(adapter_id), ignore_errors=True)

    def served_loras(self) -> list[str]:
        """The LoRA adapters the server serves now (its `/v1/models` entries with a parent)."""
        models = (self.request("GET", "/v1/models") or {}).get("data") or []
        return sorted(str(m["id"]) for m in models if m.get("parent"))

    def _load_lora(self, adapter_id: int, name: str, path: str) -> None:
        try:
            self.request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        except (EngineUpdateFailed, ServerMismatch) as err:
            raise AdapterUpdateFailed(
                f"{self.where} did not load LoRA adapter {name!r}: {err} (a server takes adapters at run time "
                "when started with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)", None) from None
        self._loras[adapter_id] = name

    def _model_for(self, lora: LoraServing | None) -> str:
        """The model name a request uses for `lora`: the base model, an adapter staged here, or an
        adapter directory (loaded first, under its own name)."""
        if lora is None:
            return self.served_model()
        if lora.adapter_id not in self._loras:
            if lora.path.startswith(STAGED_PREFIX):
                raise AdapterUpdateFailed(f"LoRA adapter {lora.adapter_id} was not staged on {self.where}", None)
            self._load_lora(lora.adapter_id, lora.name, lora.path)
        return self._loras[lora.adapter_id]

    def close(self) -> None:
        """Nothing of the server is held (it keeps running); the adapters written here are removed."""
        if self.lora_root is not None:
            shutil.rmtree(self.lora_root, ignore_errors=True)
            self.lora_root = None



# --- an AsyncLLM object ------------------------------------------------------------------------


@attrs.define
class AsyncLlmControl:
    """An `AsyncLLM` whose event loop runs in another thread (verl's and NeMo-RL's shape).

    Every call schedules the engine's coroutine on that loop (`run_coroutine_threadsafe`) and
    waits in the caller's thread; calling from the loop's own thread is refused, since waiting
    there would block the loop that must run the coroutine.
    """

    engine: Any
    loop: asyncio.AbstractEventLoop
    timeout_s: float = 600.0

    @property
    def where(self) -> str:
        return "the AsyncLLM engine"

    same_host = True  # its engine core and workers are this process's children

    def _run(self, coro_fn: Callable[[], Any]) -> Any:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            raise RuntimeError("AsyncLlmControl was called from its engine's own event loop: run the refit in "
                               "another thread (e.g. `await loop.run_in_executor(None, service.refit)`)")

        async def call() -> Any:
            return await coro_fn()

        future: Future[Any] = asyncio.run_coroutine_threadsafe(call(), self.loop)
        return future.result(timeout=self.timeout_s)

    def collective_rpc(self, method: str, request: dict[str, Any]) -> list[Any]:
        return list(self._run(lambda: self.engine.collective_rpc(method, args=(request,))))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._run(lambda: self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self._run(self.engine.start_weight_update)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(lambda: self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run(lambda: self.engine.finish_weight_update(weight_version))

    def pause(self, mode: str) -> None:
        self._run(lambda: self.engine.pause_generation(mode=mode))

    def resume(self) -> None:
        self._run(self.engine.resume_generation)

    def reset_prefix_cache(self, reset_running_requests: bool) -> bool:
        return bool(self._run(lambda: self.engine.reset_prefix_cache(reset_running_requests)))

    def set_weight_version(self, version: str) -> None:
        self._run(lambda: self.engine.update_weight_version(version))

    def weight_version(self) -> str | None:
        version = self._run(self.engine.get_weight_version)
        return None if version is None else str(version)

    def log_probs(self, input_ids: torch.Tensor, temperature: float = 1.0,
                  lora: LoraServing | None = None) -> torch.Tensor:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=temperature, prompt_logprobs=0)
        rows = []
        for i, row in enumerate(input_ids.tolist()):
            final = self._generate(TokensPrompt(prompt_token_ids=row), params, f"rl-refit-logprobs-{id(self)}-{i}",
                                   lora)
            per_pos = final.prompt_logprobs[1:]
            rows.append([float(pos[tok].logprob) for tok, pos in zip(row[1:], per_pos, strict=True)])
        return torch.tensor(rows, dtype=torch.float32)

    def greedy(self, prompts: list[list[int]], max_tokens: int, lora: LoraServing | None = None) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        out = []
        for i, prompt in enumerate(prompts):
            final = self._generate(TokensPrompt(prompt_token_ids=prompt), params, f"rl-refit-greedy-{id(self)}-{i}",
                                   lora)
            out.append(list(final.outputs[0].token_ids))
        return out

    def _generate(self, prompt: Any, params: Any, request_id: str, lora: LoraServing | None = None) -> Any:
        """One request's final output."""
        request = lora_request(lora)
        return self._run(lambda: _last(self.engine.generate(prompt, params, request_id=request_id,
                                                            lora_request=request)))

    def close(self) -> None:
        return None  # the engine is the caller's


async def _last(stream: Any) -> Any:
    final = None
    async for item in stream:
        final = item
    return final


# --- an offline LLM -----------------------------------------------------------------------------


@attrs.define
class LlmControl:
    """An offline `vllm.LLM` in this process (synchronous: it generates only when asked, so there
    is nothing to pause)."""

    llm: Any

    @property
    def where(self) -> str:
        return "the in-process vLLM LLM"

    same_host = True

    def collective_rpc(self, method: str, request: dict[str, Any]) -> list[Any]:
        return list(self.llm.collective_rpc(method, args=(request,)))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update()

    def pause(self, mode: str) -> None:
        return None

    def resume(self) -> None:
        return None

    def reset_prefix_cache(self, reset_running_requests: bool) -> bool:
        return bool(self.llm.reset_prefix_cache())

    def set_weight_version(self, version: str) -> None:
        self.llm.update_weight_version(version)

    def weight_version(self) -> str | None:
        version = self.llm.get_weight_version()
        return None if version is None else str(version)

    def log_probs(self, input_ids: torch.Tensor, temperature: float = 1.0,
                  lora: LoraServing | None = None) -> torch.Tensor:
        from adapters.vllm.client import LlmLogProbs

        return LlmLogProbs(self.llm)(input_ids, temperature, lora)[0]

    def greedy(self, prompts: list[list[int]], max_tokens: int, lora: LoraServing | None = None) -> list[list[int]]:
        from adapters.vllm.client import greedy_tokens

        return greedy_tokens(self.llm, prompts, max_tokens, lora)

    def close(self) -> None:
        return None


# --- a Ray actor --------------------------------------------------------------------------------


@attrs.define
class RayControl:
    """A Ray actor that exposes vLLM's engine methods (an `AsyncLLM` wrapped in an actor, as verl
    and NeMo-RL do): `collective_rpc`, the weight-transfer methods, `pause_generation`,
    `resume_generation`, `reset_prefix_cache`, `update_weight_version`, `get_weight_version`, and
    `generate` (AsyncLLM's: an async generator, read as a Ray stream) for the probe's log-probs
    and greedy tokens."""

    actor: Any
    timeout_s: float = 600.0

    @property
    def where(self) -> str:
        return f"the Ray actor {self.actor!r}"

    same_host: bool = False  # a Ray actor may run on any node: say True when it runs on this one

    def _get(self, ref: Any) -> Any:
        import ray

        return ray.get(ref, timeout=self.timeout_s)

    def collective_rpc(self, method: str, request: dict[str, Any]) -> list[Any]:
        return list(self._get(self.actor.collective_rpc.remote(method, args=(request,))))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._get(self.actor.init_weight_transfer_engine.remote(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self._get(self.actor.start_weight_update.remote())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._get(self.actor.update_weights.remote(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._get(self.actor.finish_weight_update.remote())
        if weight_version is not None:
            self.set_weight_version(weight_version)

    def pause(self, mode: str) -> None:
        self._get(self.actor.pause_generation.remote(mode=mode))

    def resume(self) -> None:
        self._get(self.actor.resume_generation.remote())

    def reset_prefix_cache(self, reset_running_requests: bool) -> bool:
        return bool(self._get(self.actor.reset_prefix_cache.remote(reset_running_requests)))

    def set_weight_version(self, version: str) -> None:
        self._get(self.actor.update_weight_version.remote(version))

    def weight_version(self) -> str | None:
        version = self._get(self.actor.get_weight_version.remote())
        return None if version is None else str(version)

    def log_probs(self, input_ids: torch.Tensor, temperature: float = 1.0,
                  lora: LoraServing | None = None) -> torch.Tensor:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=temperature, prompt_logprobs=0)
        rows = []
        for i, row in enumerate(input_ids.tolist()):
            final = self._generate(TokensPrompt(prompt_token_ids=row), params, f"rl-refit-logprobs-{id(self)}-{i}",
                                   lora)
            rows.append([float(pos[tok].logprob) for tok, pos in zip(row[1:], final.prompt_logprobs[1:], strict=True)])
        return torch.tensor(rows, dtype=torch.float32)

    def greedy(self, prompts: list[list[int]], max_tokens: int, lora: LoraServing | None = None) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [list(self._generate(TokensPrompt(prompt_token_ids=p), params, f"rl-refit-greedy-{id(self)}-{i}",
                                    lora).outputs[0].token_ids) for i, p in enumerate(prompts)]

    def _generate(self, prompt: Any, params: Any, request_id: str, lora: LoraServing | None) -> Any:
        """One request's final output: the actor's `generate` streamed back, its last item."""
        stream = self.actor.generate.options(num_returns="streaming").remote(
            prompt, params, request_id=request_id, lora_request=lora_request(lora))
        final = None
        for ref in stream:
            final = self._get(ref)
        if final is None:
            raise EngineUpdateFailed(f"{self.where}: generate returned nothing for {request_id}")
        return final

    def close(self) -> None:
        return None

