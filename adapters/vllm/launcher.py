"""The vLLM server rl-refit starts itself (`rollout.deployment: disaggregated`), and the cold starts
refits are compared with: the server a user runs (docs/attach.md), started on loopback.

`ServerProcess.start` runs `python -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs)
with the engine's arguments as vLLM's own flags (`server_args`), dev mode on, rl-refit's
weight-transfer backend and worker extension, in a process group of its own, and waits until
`/health` answers. From then on it is driven exactly as an attached server is
(adapters.vllm.attached over adapters.vllm.controls.HttpControl); `OwnedServer` is that control
plus the process, which `close()` stops.

Nothing is left behind, whatever ends the trainer:
- vLLM's IPC sockets and other temporary files go into a private directory (0700) of this
  server's, removed with it;
- a keeper (adapters.vllm.guardian in its keeper mode, started with the server) holds a pipe from
  the trainer: when the pipe closes without the trainer's release (SIGKILL, OOM), it kills the
  server's process group and removes the directory and the log;
- the log is removed after a clean run and kept after any failure (errors name it).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import structlog

from adapters.vllm.controls import HttpControl
from adapters.vllm.errors import EngineProcessError
from adapters.vllm.guardian import Guardian, group_runs
from adapters.vllm.protocol import EXTENSION, R, Request, WorkerQueries, replies_of
from adapters.vllm.session import BACKEND

log = structlog.get_logger()

SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # `vllm serve` (the CPU build's command cannot find its package)
_PROGRESS_EVERY_S = 30.0
_POLL_S = 0.5
_STOP_GRACE_S = 30.0

# --- the server's command line ------------------------------------------------------------------


def server_args(engine_kwargs: Mapping[str, Any]) -> list[str]:
    """vLLM's command-line flags for `EngineArgs(**engine_kwargs)`, as its argument parser reads
    them: `--name-with-dashes VALUE`; a bool as `--name` or `--no-name`; a list as the flag then
    its values; a dict as JSON text; None left out (vLLM's default)."""
    out: list[str] = []
    for key, value in engine_kwargs.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, list | tuple):
            out += [flag, *(str(v) for v in value)]
        elif isinstance(value, Mapping):
            out += [flag, json.dumps(value, separators=(",", ":"))]
        else:
            out += [flag, str(value)]
    return out


def free_port(host: str) -> int:
    """A TCP port on `host` that nothing listens on now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# --- what went wrong, from the server's log -------------------------------------------------------

_WRAPPERS = ("initialization failed", "See root cause", "See stack trace", "Worker failed with error")
# "(EngineCore pid=12) ERROR 12-02 01:16:29 [core.py:953] " before each line vLLM's processes log
_LOG_PREFIX = re.compile(r"^\((?P<proc>[^)]*)\)\s+(?:[A-Z]+\s+\d\d-\d\d \d\d:\d\d:\d\d\s+\[(?P<where>[^\]]*)\]\s?)?")
_CAUSE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception)(?:\[[^\]]*\])?: ")
_NOT_MESSAGE = ("Traceback", "File ", "The above exception", "During handling", "^")
_CONTINUATION_LINES = 8


def root_cause(text: str) -> str | None:
    """The first exception line of a server's log that is not one of vLLM's wrappers ("Engine
    core initialization failed. See root cause above"), from whichever process printed it, with
    the lines of the same message that follow it (vLLM's kernel-selection errors list one reason a
    line), joined with "; ". None when the log holds no exception line."""
    lines = text.splitlines()
    for i, raw in enumerate(lines):
        prefix = _LOG_PREFIX.match(raw)
        body = raw[prefix.end():].strip() if prefix else raw.strip()
        if not _CAUSE.match(body) or any(w in body for w in _WRAPPERS):
            continue
        message = [body]
        for nxt in lines[i + 1:i + 1 + _CONTINUATION_LINES]:
            same = _LOG_PREFIX.match(nxt)
            if (same.group(0) if same else "") != (prefix.group(0) if prefix else ""):
                break  # another process, another log record, or the line after the traceback
            part = nxt[same.end():].strip() if same else nxt.strip()
            if not part or part.startswith(_NOT_MESSAGE) or _CAUSE.match(part):
                break
            message.append(part)
        return "; ".join(message)
    return None


def diagnosis(path: Path, fallback: str = "") -> str:
    """What went wrong, in one line: the log's root cause (else `fallback`), then the log's path."""
    try:
        cause = root_cause(path.read_text(errors="replace"))
    except OSError:
        cause = None
    if cause is None and fallback.strip():
        cause = fallback.strip().splitlines()[0]
    return f"{cause}; engine log: {path}" if cause else f"engine log: {path}"


def ended(proc: subprocess.Popen[bytes]) -> str:
    """How a finished process ended, in words: "was killed by SIGKILL", "exited with status 1"."""
    code = proc.returncode
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


# vLLM names its IPC sockets VLLM_RPC_BASE_PATH/<uuid4>, and a Unix socket's path holds at most 107
# bytes: the directory may take 107 - 37.
_MAX_PRIVATE_DIR = 70


def _private_dir() -> Path:
    """A directory of the server's own (0700) for its IPC sockets and temporary files: in the
    temporary directory, or under /tmp where that path is too long for vLLM's sockets."""
    private = tempfile.mkdtemp(prefix="rl-refit-vllm-")
    if len(private) > _MAX_PRIVATE_DIR and os.path.isdir("/tmp"):
        os.rmdir(private)
        private = tempfile.mkdtemp(prefix="rl-refit-vllm-", dir="/tmp")
    return Path(private)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --- the process ----------------------------------------------------------------------------------


@attrs.define
class Reaper:
    """Stops a server and every process of its group (vLLM's engine core, its workers and their
    resource tracker, which outlive a leader killed from outside), then removes the server's
    private directory. The server is started as a session leader, so its group id is its pid.
    Registered at exit, so that a trainer that ends any other way leaves none of them behind."""

    proc: subprocess.Popen[bytes]
    private_dir: Path | None = None
    _done: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        atexit.register(self.kill)

    def stop(self, timeout_s: float) -> None:
        """Ask the server to shut down (SIGTERM: vLLM stops its engine core and workers, which
        release their shared memory), wait up to `timeout_s` for the whole group to exit, then
        kill what is left of it."""
        deadline = time.monotonic() + timeout_s
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout_s)
        while time.monotonic() < deadline and group_runs(self.proc.pid):
            time.sleep(0.1)  # the engine core and workers finish their own shutdown
        self.kill()

    def kill(self) -> None:
        """SIGKILL the whole group now (idempotent)."""
        if self._done:
            return
        self._done = True
        atexit.unregister(self.kill)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        if self.private_dir is not None:
            shutil.rmtree(self.private_dir, ignore_errors=True)


@attrs.define
class ServerProcess:
    """A vLLM server process this trainer started.

    Attributes:
        proc: the server (the leader of its process group).
        url: its base URL (loopback).
        log_path: its output (vLLM's processes log there).
        reaper: stops its process group and removes its private directory.
        keeper: the keeper process that stops it if this trainer dies (None in tests).
        failed: a request, a worker or the server failed: the log is kept (errors name it).
    """

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    reaper: Reaper
    keeper: Any = None
    failed: bool = False
    private_dir: Path | None = None  # removed with the server (vLLM's IPC sockets, the LoRA adapters written for it)

    def __attrs_post_init__(self) -> None:
        atexit.register(self.close, 5.0)  # a trainer that exits without closing: the log kept only after a failure

    @classmethod
    def start(cls, python: str, engine_kwargs: Mapping[str, Any], *, env: Mapping[str, str],
              host: str = "127.0.0.1", start_timeout_s: float = 600.0, log_path: str | Path | None = None,
              notify: Callable[[str], None] | None = None, transfer: bool = True,
              keeper: bool = True, owned: tuple[str, ...] = (), role: str = "the vLLM server") -> ServerProcess:
        """Start the server and wait until it serves.

        Args:
            python: the interpreter (vLLM and rl-refit installed).
            engine_kwargs: vLLM's engine arguments (`server_args` turns them into flags);
                `worker_extension_cls` defaults to rl-refit's extension.
            env: the server's environment (the composition root's reading of this process's, with
                the engine's variables); dev mode and the private temporary directory are added.
            host: the address it binds (loopback: dev mode's routes are open to whoever reaches it).
            start_timeout_s: bound on the start (rollout.engine_kwargs.vllm.start_timeout_s).
            log_path: its output (default: a file in the temporary directory).
            notify: told every 30 s that it does not serve yet (default: a line on stderr).
            transfer: start rl-refit's weight-transfer backend (a cold start for comparison needs
                none).
            keeper: start the keeper that stops it if this process dies.
            owned: other paths made for it (the embedded model's config directory), which the
                keeper removes with it if this process dies (closing them is the engine's).
            role: what the waiting lines and a timeout call it (a cold start says so).

        Returns:
            The serving ServerProcess. Raises EngineProcessError (with the log's root cause and
            path) when it exits, or does not serve within the bound (it is then killed).
        """
        private = _private_dir()
        out = Path(log_path) if log_path is not None else Path(tempfile.mkstemp(prefix="rl-refit-engine-",
                                                                                  suffix=".log")[1])
        kwargs = {"worker_extension_cls": EXTENSION, **engine_kwargs}
        if transfer:
            kwargs["weight_transfer_config"] = {"backend": BACKEND}
        port = free_port(host)
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        command = [python, "-m", SERVER_MODULE, *server_args(kwargs), "--host", host, "--port", str(port)]
        server_env = {**env, "VLLM_SERVER_DEV_MODE": "1",
                      "TMPDIR": str(private), "VLLM_RPC_BASE_PATH": str(private)}
        if kwargs.get("enable_lora"):  # adapters go in through vLLM's own LoRA routes (docs/lora.md)
            server_env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        with out.open("wb") as logf:
            proc = subprocess.Popen(command, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=server_env, start_new_session=True)
        reaper = Reaper(proc, private)
        server = cls(proc, url, out, reaper, private_dir=private)
        try:
            if keeper:
                server.keeper = Guardian.keep(proc.pid, [str(private), str(out), *owned])
            server._wait(start_timeout_s, notify or _say, role)
        except BaseException:  # Ctrl-C, SIGTERM, a timeout: nothing of the server is left running
            server.failed = True
            server.close(0.0)
            raise
        log.info("vllm server started", pid=proc.pid, url=url, log=str(out))
        return server

    def _wait(self, timeout_s: float, notify: Callable[[str], None], role: str) -> None:
        start = time.monotonic()
        said = 0.0
        while not self._healthy():
            if self.proc.poll() is not None:
                how = f"the server (pid {self.proc.pid}) {ended(self.proc)} before it served"
                raise EngineProcessError(f"the vLLM engine failed to start: {diagnosis(self.log_path, how)}")
            waited = time.monotonic() - start
            if waited > timeout_s:
                raise EngineProcessError(
                    f"{role} (pid {self.proc.pid}) did not serve within {timeout_s:g} s "
                    f"(rollout.engine_kwargs.vllm.start_timeout_s) and was killed, with its engine processes: "
                    f"{diagnosis(self.log_path)}")
            if waited - said >= _PROGRESS_EVERY_S:
                said = waited
                notify(f"waiting for {role} (pid {self.proc.pid}) at {self.url} to start: {waited:.0f} s "
                       f"of {timeout_s:g} s (rollout.engine_kwargs.vllm.start_timeout_s); its log: {self.log_path}")
            time.sleep(_POLL_S)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5.0) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.URLError, ValueError):
            return False

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def died(self) -> EngineProcessError:
        """The error for a server that is gone (its process group is killed with it)."""
        self.failed = True
        self.reaper.kill()
        return EngineProcessError(f"the vLLM server (pid {self.proc.pid}) {ended(self.proc)}; its engine processes "
                                  f"were stopped: {diagnosis(self.log_path)}")

    def close(self, timeout_s: float = _STOP_GRACE_S) -> None:
        """Stop the server (SIGTERM, then the whole group killed past `timeout_s`), release the
        keeper, remove the private directory; the log is removed after a clean run and kept
        after any failure. Idempotent."""
        atexit.unregister(self.close)
        if self.keeper is not None:
            self.keeper.release()
            self.keeper = None
        was_alive = self.alive
        self.reaper.stop(timeout_s)
        if not was_alive and not self.failed:
            self.failed = True  # it died on its own: keep what it said
        if not self.failed:
            self.log_path.unlink(missing_ok=True)


# --- the server as an engine's control plane --------------------------------------------------


@attrs.define
class OwnedHttpControl(HttpControl):
    """The HTTP control of a server this trainer started (adapters.vllm.controls.HttpControl),
    which `close()` stops; a request the dead server cannot answer raises its end, with the log's
    root cause (EngineProcessError), and any failed request keeps the log."""

    server: ServerProcess | None = None

    @property
    def where(self) -> str:
        pid = "" if self.server is None else f" (pid {self.server.proc.pid})"
        return f"the vLLM server{pid} rl-refit started at {self.url}"

    def request(self, method: str, path: str, body: Any = None, *, query: dict[str, Any] | None = None,
                timeout_s: float | None = None) -> Any:
        try:
            return super().request(method, path, body, query=query, timeout_s=timeout_s)
        except Exception:
            server = self.server
            if server is None:
                raise
            server.failed = True
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.proc.wait(timeout=2.0)  # one that is dying: say how it ended
            if not server.alive:
                raise server.died() from None
            raise

    def close(self) -> None:
        super().close()
        server, self.server = self.server, None
        if server is not None:
            server.close()


def start_owned(python: str, engine_kwargs: Mapping[str, Any], *, env: Mapping[str, str], start_timeout_s: float,
                api_key: str | None = None, transfer: bool = True, owned: tuple[str, ...] = (),
                role: str = "the vLLM server") -> OwnedHttpControl:
    """A server started by this trainer (`ServerProcess.start`) and its control."""
    server = ServerProcess.start(python, engine_kwargs, env=env, start_timeout_s=start_timeout_s, transfer=transfer,
                                 owned=owned, role=role)
    control = OwnedHttpControl(server.url, timeout_s=start_timeout_s + 600.0, api_key=api_key, server=server)
    if server.private_dir is not None:  # the adapters written for it go with it, whatever ends the trainer
        control.lora_root = server.private_dir / "lora"
    return control


def checkpoint_placeholders(directory: Path, names: Any) -> frozenset[str]:
    """Of `names`, the parameters of an activation-scale kind the checkpoint in `directory` has no
    tensor of: vLLM creates them for the scheme and a weight-only checkpoint leaves them at their
    load-time values."""
    from adapters.hf_checkpoint.reader import HfCheckpoint
    from adapters.vllm.worker import activation_scale_kind

    carried = {activation_scale_kind(name) for name, _ in HfCheckpoint(directory).tensor_shapes()}
    return frozenset(n for n in names if (kind := activation_scale_kind(n)) is not None and kind not in carried)


@attrs.define
class ColdServer(WorkerQueries):
    """A server started from a checkpoint directory and queried as it loaded it (no refit): the
    reference a refitted engine is compared with (ports.engine_inspection, its prompt log-probs
    and greedy tokens)."""

    control: OwnedHttpControl
    directory: Path

    def placeholders(self, names: Any) -> frozenset[str]:
        """The parameters of an activation-scale kind the checkpoint has no tensor of
        (checkpoint_placeholders)."""
        return checkpoint_placeholders(self.directory, names)

    def call_all(self, request: Request[R]) -> list[R]:
        return replies_of(request, self.control.collective_rpc(request.METHOD, request.to_plain()))

    def log_probs(self, input_ids: Any) -> Any:
        return self.control.log_probs(input_ids)

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return self.control.greedy(prompts, max_tokens)

    def close(self) -> None:
        self.control.close()
