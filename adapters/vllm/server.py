"""The vLLM engine host: a `vllm.LLM` in a process of its own, driven by a trainer over a control
connection (adapters.vllm.control), with rl-refit's worker extension in every worker.

Run by adapters.vllm.remote.EngineProcess as `python -m adapters.vllm.server SPEC.json`, in the
environment where vLLM is installed. SPEC holds the engine arguments, the trainer's address and
a token. The host starts the engine (vLLM's multiprocess engine: the workers are processes of
their own), connects back to the trainer, proves the token, and then serves requests one at a
time until told to shut down or until the trainer goes away:

| op | what the host does | result |
|---|---|---|
| `rpc` {method, args} | `LLM.collective_rpc(method, args)`, methods `rl_refit_*` only | one result per worker |
| `log_probs` {input_ids, temperature} | prompt log-probs of each row | [B][T-1] floats |
| `greedy` {prompts, max_tokens} | greedy continuations | token ids per prompt |
| `shutdown` | replies, then exits | null |
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from typing import Any

from adapters.vllm.client import shutdown_llm
from adapters.vllm.control import Channel
from adapters.vllm.engine_args import EXTENSION

METHOD_PREFIX = "rl_refit_"


def _handle(llm: Any, message: dict[str, Any]) -> tuple[Any, bool]:
    """(result, keep serving) for one request."""
    import torch

    from adapters.vllm.client import LlmLogProbs, greedy_tokens

    op = message.get("op")
    if op == "rpc":
        method = str(message.get("method", ""))
        if not method.startswith(METHOD_PREFIX):
            raise ValueError(f"rpc method {method!r} is not one of the worker extension's ({METHOD_PREFIX}*)")
        return list(llm.collective_rpc(method, args=tuple(message.get("args") or ()))), True
    if op == "log_probs":
        logp, _ = LlmLogProbs(llm)(torch.tensor(message["input_ids"], dtype=torch.long),
                                   float(message.get("temperature", 1.0)))
        return logp.tolist(), True
    if op == "greedy":
        return greedy_tokens(llm, [list(p) for p in message["prompts"]], int(message["max_tokens"])), True
    if op == "shutdown":
        return None, False
    raise ValueError(f"unknown op {op!r}")


def serve(llm: Any, channel: Channel) -> None:
    """Answer requests until `shutdown` or until the trainer closes the connection."""
    from adapters.vllm.errors import EngineProcessError

    while True:
        try:
            message = channel.receive(None)
        except EngineProcessError:
            return  # the trainer is gone
        try:
            result, more = _handle(llm, message)
            reply: dict[str, Any] = {"ok": True, "result": result}
        except Exception as err:  # the trainer decides what a failure means
            traceback.print_exc(file=sys.stderr)
            reply, more = {"ok": False, "error": type(err).__name__, "message": str(err)[:8000]}, True
        channel.send(reply)
        if not more:
            return


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m adapters.vllm.server SPEC.json", file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8") as f:
        spec = json.load(f)
    sock = socket.create_connection((spec["trainer_host"], int(spec["trainer_port"])), timeout=60)
    channel = Channel(sock, "the trainer")
    try:
        from adapters.vllm.client import start_llm

        llm = start_llm(**{"worker_extension_cls": EXTENSION, **spec["engine_kwargs"]})
        workers = llm.collective_rpc("rl_refit_ready")
    except BaseException as err:
        traceback.print_exc(file=sys.stderr)
        channel.send({"token": spec["token"], "ok": False, "error": type(err).__name__, "message": str(err)[:8000]})
        channel.close()
        return 1
    channel.send({"token": spec["token"], "ok": True, "result": {"pid": os.getpid(), "workers": workers}})
    try:
        serve(llm, channel)
    finally:
        channel.close()
        shutdown_llm(llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
