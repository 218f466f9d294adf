"""A vLLM server started the way a user starts one, for the attached tests: a separate process,
`python -m vllm.entrypoints.openai.api_server` (the `vllm serve` command of this environment's
CPU build, whose distribution name `vllm serve` does not find), dev mode, loopback, rl-refit's
weight-transfer backend and worker extension."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[2]
START_CEILING_S = 900.0  # two servers starting at once on two loaded cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(model: Path, port: int, extra: Sequence[str] = ()) -> list[str]:
    """The command a user types (with this environment's Python), as docs/attach.md gives it."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port),
            "--weight-transfer-config", json.dumps({"backend": "rl_refit"}),
            "--worker-extension-cls", "adapters.vllm.extension.RefitWorkerExtension",
            "--skip-tokenizer-init", "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "128",
            "--seed", "0", *extra]


def server_environment() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "RL_REFIT_VLLM_CPU_EMULATION": "auto",
                "VLLM_LOGGING_STREAM": "ext://sys.stderr", "PYTHONPATH": str(ROOT)})
    return env


@attrs.define
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=60)

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=10) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False


@contextlib.contextmanager
def vllm_server(model: Path, logdir: Path, extra: Sequence[str] = ()) -> Iterator[Server]:
    """A running server of `model` (killed with its engine processes afterwards)."""
    port = free_port()
    log = logdir / f"vllm-server-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(server_command(model, port, extra), stdout=out, stderr=subprocess.STDOUT,
                                env=server_environment(), cwd=str(ROOT), start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + START_CEILING_S
        while not server.healthy():
            if not server.alive():
                raise RuntimeError(f"the vLLM server exited while starting:\n{server.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the vLLM server did not start within {START_CEILING_S:g} s:\n{server.tail()}")
            time.sleep(1.0)
        yield server
    finally:
        server.kill()


@attrs.define
class StreamingClient:
    """An OpenAI client that streams completions from `url` without pause (bounded: at most
    `max_requests`), recording every request's outcome. `hold()` / `go()` stop and restart it
    between requests (the comparisons with cold starts run alone, so that batching cannot change
    their bits)."""

    url: str
    model: str
    prompt: list[int]
    max_requests: int = 400
    completed: int = 0
    failures: list[str] = attrs.field(factory=list)
    chunks: int = 0
    _stop: threading.Event = attrs.field(factory=threading.Event)
    _running: threading.Event = attrs.field(factory=threading.Event)
    _idle: threading.Event = attrs.field(factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> StreamingClient:
        self._running.set()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set() and self.completed + len(self.failures) < self.max_requests:
            if not self._running.is_set():
                self._idle.set()
                self._running.wait(1.0)
                continue
            self._idle.clear()
            self._one()
        self._idle.set()

    def _one(self) -> None:
        body = {"model": self.model, "prompt": self.prompt, "max_tokens": 24, "temperature": 0.0, "stream": True,
                "ignore_eos": True, "return_token_ids": True}
        req = urllib.request.Request(f"{self.url}/v1/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        tokens = 0
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                for raw in resp:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if "error" in chunk:
                        self.failures.append(f"stream error: {chunk['error']}")
                        return
                    self.chunks += 1
                    tokens += len(chunk["choices"][0].get("token_ids") or [])
        except Exception as err:
            self.failures.append(f"{type(err).__name__}: {err}")
            return
        if tokens != 24:
            self.failures.append(f"a stream ended after {tokens} of 24 tokens")
            return
        self.completed += 1

    def hold(self, timeout_s: float = 600.0) -> None:
        """Stop between requests; returns once no request is in flight."""
        self._running.clear()
        self._idle.wait(timeout_s)

    def go(self) -> None:
        self._idle.clear()
        self._running.set()

    def stop(self) -> None:
        self._stop.set()
        self._running.set()
        if self._thread is not None:
            self._thread.join(600)
