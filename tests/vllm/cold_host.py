"""Cold starts for the real-engine tests, each a fresh in-process `vllm.LLM` in a process forked from
one that has already imported vLLM: `python -m tests.vllm.cold_host ADDRESS` serves them.

A refit is compared with a cold start of the same export (app.services.engine_demo.ColdStartComparer).
`refit demo vllm` starts that cold start as one process of its own (adapters.vllm.cold_start), which
imports vLLM first: about 20 s on this machine before the first weight loads. Here each cold start is
one process forked from a host that imported vLLM once: it sets the engine's environment and serves
exactly as that process does (adapters.vllm.cold_start.serve: `vllm.LLM` from the export with the
same engine arguments, vLLM's own loader reading the export from disk, multiprocessing off), then
exits. Nothing of one cold start survives into the next: each is a process of its own.

The session fixture `cold_cache` (tests/vllm/conftest.py) starts one host per xdist worker and sets
`COLD_HOST_ENV` to its address, which scenario processes inherit; `with_cold_host(services)` routes
a comparer's cold starts there when it is set. An engine of several workers (tensor parallel) is
started as a server, as before: an in-process engine has one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

import attrs

from adapters.vllm.cold_start import log_probs_of, recv, send
from adapters.vllm.cold_start import serve as serve_queries
from adapters.vllm.launcher import checkpoint_placeholders
from adapters.vllm.protocol import R, Request, WorkerQueries, replies_of

COLD_HOST_ENV = "RL_REFIT_TEST_COLD_HOST"
AUTHKEY = b"rl-refit-cold-host"


class ColdHostError(RuntimeError):
    """The forked cold start failed: its error's line (its traceback is in the host's log)."""


# --- the client side (any environment with the project: the trainer's .venv or .venv-vllm) ---------


@attrs.define
class ForkedColdStart(WorkerQueries):
    """One cold start: a forked child holding the engine (adapters.vllm.cold_start.serve), queried
    over a connection as ColdProcess queries its process (ports.engine_inspection)."""

    conn: Connection
    directory: Path

    def _ask(self, op: str, *args: Any) -> Any:
        send(self.conn, (op, args))
        status, value = recv(self.conn)
        if status != "ok":
            raise ColdHostError(value)
        return value

    def call_all(self, request: Request[R]) -> list[R]:
        return replies_of(request, self._ask("rpc", request.METHOD, request.to_plain()))

    def log_probs(self, input_ids: Any) -> Any:
        return log_probs_of(self._ask("log_probs", input_ids.tolist()))

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return self._ask("greedy", prompts, max_tokens)  # type: ignore[no-any-return]

    def placeholders(self, names: Any) -> frozenset[str]:
        return checkpoint_placeholders(self.directory, names)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            send(self.conn, ("close", ()))
        self.conn.close()


@attrs.define
class ForkedColdStarts:
    """`services.engines` with cold starts from the host at `address`; the engine's other calls
    (and a cold start of several workers) go to `engines`."""

    engines: Any
    address: str

    def cold_start(self, directory: str | Path) -> Any:
        from adapters.vllm.factory import cold_start_arguments, engine_workers

        engines = self.engines
        kwargs, env = cold_start_arguments(engines.config.rollout.engine_kwargs.vllm, engines.engine_start("vllm"),
                                           engines.engine_host(), str(directory))
        if engine_workers(kwargs) > 1:
            return engines.cold_start(directory)
        conn = Client(self.address, family="AF_UNIX", authkey=AUTHKEY)
        send(conn, {"kwargs": kwargs, "env": {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}})
        status, value = recv(conn)
        if status != "ok":
            conn.close()
            raise ColdHostError(value)
        return ForkedColdStart(conn, Path(directory))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engines, name)


@attrs.define
class _ColdHostServices:
    services: Any
    engines: ForkedColdStarts

    @property
    def embedded(self) -> Any:
        return self.services.embedded

    def __getattr__(self, name: str) -> Any:
        return getattr(self.services, name)


def with_cold_host(services: Any) -> Any:
    """`services` whose cold starts are forked from the host named by COLD_HOST_ENV (unchanged
    when it is unset: the engine's own cold starts)."""
    address = os.environ.get(COLD_HOST_ENV)
    if not address:
        return services
    return _ColdHostServices(services, ForkedColdStarts(services.engines, address))


# --- the host (.venv-vllm) ----------------------------------------------------------------------------


def _serve_one(conn: Connection) -> None:
    """In the forked child: start the engine the request names, answer queries until `close`
    (adapters.vllm.cold_start.serve, as a one-process cold start does)."""
    request = recv(conn)
    os.environ.update(request["env"])
    with contextlib.suppress(EOFError):
        serve_queries(conn, request["kwargs"])


def serve(address: str) -> None:
    """Import what a cold start needs once, then fork a child per connection."""
    import vllm  # imported before the forks: what every cold start would import
    import vllm.v1.engine.llm_engine  # noqa: F401

    import adapters.vllm.client
    import adapters.vllm.extension  # noqa: F401
    import tests.vllm.extensions  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reaped as they exit
    listener = Listener(address, family="AF_UNIX", authkey=AUTHKEY)
    print(f"cold host ready at {address}", file=sys.stderr, flush=True)
    while True:
        conn = listener.accept()
        if os.fork() == 0:
            listener.close()
            code = 0
            try:
                _serve_one(conn)
            except BaseException:
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)  # nothing of the host's exit handlers runs in a child
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
