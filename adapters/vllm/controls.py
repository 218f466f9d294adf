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
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import attrs
import torch

from adapters.system.http import JsonServer
from adapters.vllm.protocol import from_json_safe, json_safe
from domain.errors import EngineUpdateFailed, ServerMismatch, ServerUnreachable

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

    def log_probs(self, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """log p(token_t | tokens_<t) for t >= 1, one request per row ([B, T-1], float32)."""
        ...

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy continuations, one request at a time."""
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

    def log_probs(self, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        rows = []
        for row in input_ids.tolist():
            answer = self.request("POST", "/v1/completions", {
                "model": self.served_model(), "prompt": row, "max_tokens": 1, "temperature": temperature,
                "prompt_logprobs": 0})
            per_pos = answer["choices"][0]["prompt_logprobs"][1:]  # position 0 has none
            rows.append([float(pos[str(tok)]["logprob"]) for tok, pos in zip(row[1:], per_pos, strict=True)])
        return torch.tensor(rows, dtype=torch.float32)

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        out = []
        for prompt in prompts:
            answer = self.request("POST", "/v1/completions", {
                "model": self.served_model(), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True})
            out.append([int(t) for t in answer["choices"][0]["token_ids"]])
        return out

    def close(self) -> None:
        return None  # nothing is held: the server keeps running



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

    def log_probs(self, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=temperature, prompt_logprobs=0)
        rows = []
        for i, row in enumerate(input_ids.tolist()):
            final = self._generate(TokensPrompt(prompt_token_ids=row), params, f"rl-refit-logprobs-{id(self)}-{i}")
            per_pos = final.prompt_logprobs[1:]
            rows.append([float(pos[tok].logprob) for tok, pos in zip(row[1:], per_pos, strict=True)])
        return torch.tensor(rows, dtype=torch.float32)

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        out = []
        for i, prompt in enumerate(prompts):
            final = self._generate(TokensPrompt(prompt_token_ids=prompt), params, f"rl-refit-greedy-{id(self)}-{i}")
            out.append(list(final.outputs[0].token_ids))
        return out

    def _generate(self, prompt: Any, params: Any, request_id: str) -> Any:
        """One request's final output."""
        return self._run(lambda: _last(self.engine.generate(prompt, params, request_id=request_id)))

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
        return None

    def weight_version(self) -> str | None:
        return None

    def log_probs(self, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        from adapters.vllm.client import LlmLogProbs

        return LlmLogProbs(self.llm)(input_ids, temperature)[0]

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from adapters.vllm.client import greedy_tokens

        return greedy_tokens(self.llm, prompts, max_tokens)

    def close(self) -> None:
        return None


# --- a Ray actor --------------------------------------------------------------------------------


@attrs.define
class RayControl:
    """A Ray actor that exposes vLLM's engine methods (an `AsyncLLM` or `LLM` wrapped in an actor,
    as verl and NeMo-RL do): `collective_rpc`, the weight-transfer methods, `pause_generation`,
    `resume_generation`, `reset_prefix_cache`, `update_weight_version`, `get_weight_version`."""

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

    def log_probs(self, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        raise NotImplementedError("prompt log-probs through a Ray actor: expose them on the actor, or verify "
                                  "through the server's HTTP API (rollout.engine_kwargs.vllm.url)")

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        raise NotImplementedError("greedy tokens through a Ray actor: verify through the server's HTTP API")

    def close(self) -> None:
        return None

