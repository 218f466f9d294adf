"""The vLLM engine host: a `vllm.LLM` in a process of its own, driven by a trainer over a control
connection (adapters.vllm.control), with rl-refit's worker extension in every worker.

Run by adapters.vllm.remote.EngineProcess as `python -m adapters.vllm.server SPEC.json`, in the
environment where vLLM is installed. SPEC holds the engine arguments, the trainer's address, a
token and the engine's private temporary directory. `main` is this process's composition root: it
points the process's temporary files (vLLM's IPC sockets) at that directory before vLLM starts. The host starts the engine (vLLM's multiprocess engine: the workers are processes of
their own), connects back to the trainer, says `Hello` with the token, and then serves requests
(adapters.vllm.control.HOST_REQUESTS) one at a time until told to shut down or until the
trainer goes away:

| request | what the host does | reply |
|---|---|---|
| `CallWorkers` {method, request} | `LLM.collective_rpc(method, args=(request,))`, methods `rl_refit_*` only | `WorkerAnswers`: one plain answer per worker |
| `HostLogProbs` {input_ids, temperature, lora} | prompt log-probs of each row (with the LoRA adapter named) | `LogProbsReply`: [B][T-1] floats |
| `HostGreedy` {prompts, max_tokens, lora} | greedy continuations (with the LoRA adapter named) | `Tokens`: token ids per prompt |
| `ResetPrefixCache` | `LLM.reset_prefix_cache()` (after a LoRA adapter is replaced) | `Done` |
| `Shutdown` | replies, then exits | `Done` |

A request that fails is answered with its ErrorReply (adapters.vllm.protocol).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

from adapters.vllm.client import shutdown_llm
from adapters.vllm.control import (
    HOST_REQUESTS,
    CallWorkers,
    Channel,
    Hello,
    HostGreedy,
    HostLogProbs,
    HostRequest,
    LogProbsReply,
    ResetPrefixCache,
    Shutdown,
    Tokens,
    WorkerAnswers,
)
from adapters.vllm.lora import LoraServing
from adapters.vllm.protocol import EXTENSION, TAG, Done, ErrorReply, Ready, Record, reply_of

METHOD_PREFIX = "rl_refit_"


def _call_workers(llm: Any, request: CallWorkers) -> Record:
    if not request.method.startswith(METHOD_PREFIX):
        raise ValueError(f"rpc method {request.method!r} is not one of the worker extension's ({METHOD_PREFIX}*)")
    return WorkerAnswers(llm.collective_rpc(request.method, args=(request.request,)))


def _log_probs(llm: Any, request: HostLogProbs) -> Record:
    import torch

    from adapters.vllm.client import LlmLogProbs

    logp, _ = LlmLogProbs(llm)(torch.tensor([list(row) for row in request.input_ids], dtype=torch.long),
                               request.temperature, LoraServing.of(request.lora))
    return LogProbsReply(logp.tolist())


def _greedy(llm: Any, request: HostGreedy) -> Record:
    from adapters.vllm.client import greedy_tokens

    return Tokens(greedy_tokens(llm, [list(p) for p in request.prompts], request.max_tokens,
                                LoraServing.of(request.lora)))


def _reset_prefix_cache(llm: Any, _: ResetPrefixCache) -> Record:
    llm.reset_prefix_cache()
    return Done()


HANDLERS: dict[type[HostRequest[Any]], Callable[[Any, Any], Record]] = {
    CallWorkers: _call_workers, HostLogProbs: _log_probs, HostGreedy: _greedy, ResetPrefixCache: _reset_prefix_cache,
    Shutdown: lambda _llm, _r: Done(),
}


def _handle(llm: Any, message: dict[str, Any]) -> tuple[Record, bool]:
    """(reply, keep serving) for one request."""
    kind = HOST_REQUESTS.get(str(message.get(TAG)))
    if kind is None:
        raise ValueError(f"unknown request {message.get(TAG)!r}; the host answers {', '.join(HOST_REQUESTS)}")
    request = kind.from_plain(message)
    return HANDLERS[kind](llm, request), kind is not Shutdown


def serve(llm: Any, channel: Channel) -> None:
    """Answer requests until `Shutdown` or until the trainer closes the connection."""
    from adapters.vllm.errors import EngineProcessError

    while True:
        try:
            message = channel.receive(None)
        except EngineProcessError:
            return  # the trainer is gone
        try:
            reply, more = _handle(llm, message)
        except Exception as err:  # the trainer decides what a failure means
            traceback.print_exc(file=sys.stderr)
            reply, more = ErrorReply.of(err), True
        channel.send(reply.to_plain())
        if not more:
            return


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m adapters.vllm.server SPEC.json", file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8") as f:
        spec = json.load(f)
    if spec.get("private_dir"):  # the engine's own temporary directory (vLLM's IPC sockets), removed by the trainer
        os.environ["TMPDIR"] = os.environ["VLLM_RPC_BASE_PATH"] = spec["private_dir"]
        tempfile.tempdir = None  # re-read TMPDIR
    sock = socket.create_connection((spec["trainer_host"], int(spec["trainer_port"])), timeout=60)
    channel = Channel(sock, "the trainer")
    try:
        from adapters.vllm.client import start_llm

        llm = start_llm(**{"worker_extension_cls": EXTENSION, **spec["engine_kwargs"]})
        ready = Ready()
        workers = llm.collective_rpc(ready.METHOD, args=(ready.to_plain(),))
        reply_of(ready, workers)  # raises what a worker that could not prepare raised
    except BaseException as err:
        traceback.print_exc(file=sys.stderr)
        channel.send(Hello(spec["token"], os.getpid(), error=ErrorReply.of(err).to_plain()).to_plain())
        channel.close()
        return 1
    channel.send(Hello(spec["token"], os.getpid(), workers).to_plain())
    try:
        serve(llm, channel)
    finally:
        channel.close()
        shutdown_llm(llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
