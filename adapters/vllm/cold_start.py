"""The cold start a refit is compared with: one process that builds `vllm.LLM` from a checkpoint
directory (vLLM's own loader reading it from disk, multiprocessing off, one worker) and answers the
comparer's queries (ports.engine_inspection: digests, prompt log-probs, greedy tokens) over a
socket pair, until it is closed.

A server of the same export (adapters.vllm.launcher.ColdServer) serves the same bits, and costs
three processes that each import vLLM: about three times as long to start on a CPU. An engine of
several workers (tensor or pipeline parallel) still gets a server (adapters.vllm.factory).

Nothing of it outlives the trainer: it runs in a process group of its own, which the trainer kills
at exit whatever else happens (launcher.Reaper), and it exits by itself as soon as it finds the
trainer's end of the socket closed. Its output goes to a log, removed after a clean run and kept,
and named by the error, after any failure.

`python -m adapters.vllm.cold_start FD LOG` is the process; `ColdProcess.start` runs it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import attrs
import torch

from adapters.vllm.errors import EngineProcessError
from adapters.vllm.launcher import Reaper, checkpoint_placeholders, diagnosis, ended
from adapters.vllm.protocol import EXTENSION, R, Request, WorkerQueries, replies_of

_PROGRESS_EVERY_S = 30.0
_POLL_S = 0.5
_STOP_GRACE_S = 30.0
READY = "ready"


def send(conn: Connection, obj: Any) -> None:
    """`obj` (plain values: token ids and log-probs cross as lists, since a tensor's pickle names
    whatever the sender's torch was extended with) by plain pickle."""
    conn.send_bytes(pickle.dumps(obj))


def recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def log_probs_of(rows: list[list[float]]) -> torch.Tensor:
    """The prompt log-probs as the engine computed them (float32: a list of Python floats carries
    them exactly)."""
    return torch.tensor(rows, dtype=torch.float32)


@attrs.define
class ColdProcess(WorkerQueries):
    """A cold start in one process of its own (see the module's doc), queried like ColdServer.

    Attributes:
        proc: the process (the leader of its process group).
        conn: the trainer's end of the socket pair.
        directory: the checkpoint it loaded.
        log_path: its output.
        role: what its lines and errors call it.
        reaper: kills its process group at close, or at the trainer's exit.
        failed: it failed: the log is kept.
    """

    proc: subprocess.Popen[bytes]
    conn: Connection
    directory: Path
    log_path: Path
    role: str
    reaper: Reaper
    failed: bool = False

    @classmethod
    def start(cls, python: str, engine_kwargs: Mapping[str, Any], *, env: Mapping[str, str], directory: str | Path,
              start_timeout_s: float, notify: Callable[[str], None] | None = None) -> ColdProcess:
        """Start it and wait until its engine has loaded the checkpoint.

        Args:
            python: the interpreter (vLLM and rl-refit installed).
            engine_kwargs: vLLM's engine arguments (`model` is the checkpoint directory);
                `worker_extension_cls` defaults to rl-refit's extension.
            env: its environment (the engine's variables over the host's); multiprocessing is
                turned off.
            directory: the checkpoint directory (for `placeholders`).
            start_timeout_s: bound on the start (rollout.engine_kwargs.vllm.start_timeout_s).
            notify: told every 30 s that it has not loaded yet (default: a line on stderr).

        Returns:
            The loaded ColdProcess. Raises EngineProcessError (with the log's root cause and path)
            when it fails or exits before it has loaded, or does not load within the bound (it is
            then killed).
        """
        mine, theirs = socket.socketpair()
        log_path = Path(tempfile.mkstemp(prefix="rl-refit-cold-", suffix=".log")[1])
        with log_path.open("wb") as logf, theirs:
            proc = subprocess.Popen([python, "-m", "adapters.vllm.cold_start", str(theirs.fileno()), str(log_path)],
                                    stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                                    pass_fds=(theirs.fileno(),), start_new_session=True)
        role = f"the vLLM engine cold-started from {directory} (to compare with)"
        cold = cls(proc, Connection(mine.detach()), Path(directory), log_path, role, Reaper(proc))
        try:
            send(cold.conn, {"worker_extension_cls": EXTENSION, **engine_kwargs})
            cold._wait(start_timeout_s, notify or _say)
        except BaseException:  # a failure, a timeout, Ctrl-C: nothing of it is left running
            cold.failed = True
            cold.close()
            raise
        return cold

    def _wait(self, timeout_s: float, notify: Callable[[str], None]) -> None:
        begun = said = time.monotonic()
        while not self.conn.poll(_POLL_S):
            waited = time.monotonic() - begun
            if self.proc.poll() is not None:
                break  # its last words (if any) are in the socket or the log
            if waited > timeout_s:
                raise EngineProcessError(
                    f"{self.role} (pid {self.proc.pid}) did not load within {timeout_s:g} s "
                    f"(rollout.engine_kwargs.vllm.start_timeout_s) and was killed: {diagnosis(self.log_path)}")
            if time.monotonic() - said >= _PROGRESS_EVERY_S:
                said = time.monotonic()
                notify(f"waiting for {self.role} (pid {self.proc.pid}) to load: {waited:.0f} s of {timeout_s:g} s "
                       f"(rollout.engine_kwargs.vllm.start_timeout_s); its log: {self.log_path}")
        status, value = self._reply("start")
        if status != "ok" or value != READY:
            raise EngineProcessError(f"the vLLM engine failed to start: {diagnosis(self.log_path, str(value))}")

    def _reply(self, what: str) -> tuple[str, Any]:
        """The process's answer, ("ok", value) or ("error", its line); EngineProcessError with the
        log's root cause when it ended without one."""
        try:
            status, value = recv(self.conn)
        except (EOFError, OSError):
            self.failed = True
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5.0)
            how = f"{self.role} (pid {self.proc.pid}) {ended(self.proc)} at {what}"
            if what == "start":
                raise EngineProcessError(f"the vLLM engine failed to start: {diagnosis(self.log_path, how)}") from None
            raise EngineProcessError(f"{how}: {diagnosis(self.log_path)}") from None
        if status != "ok":
            self.failed = True
        return status, value

    def _ask(self, op: str, *args: Any) -> Any:
        with contextlib.suppress(OSError):  # it is gone: _reply says how
            send(self.conn, (op, args))
        status, value = self._reply(op)
        if status != "ok":
            raise EngineProcessError(f"{self.role} failed at {op}: {diagnosis(self.log_path, value)}")
        return value

    def placeholders(self, names: Any) -> frozenset[str]:
        """The parameters of an activation-scale kind the checkpoint has no tensor of
        (launcher.checkpoint_placeholders)."""
        return checkpoint_placeholders(self.directory, names)

    def call_all(self, request: Request[R]) -> list[R]:
        return replies_of(request, self._ask("rpc", request.METHOD, request.to_plain()))

    def log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        return log_probs_of(self._ask("log_probs", input_ids.tolist()))

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return self._ask("greedy", prompts, max_tokens)

    def close(self) -> None:
        """Stop it (its engine shuts down and it exits; its group is killed past the grace, or at
        once after a failure) and remove its log after a clean run. Idempotent."""
        with contextlib.suppress(OSError):
            if self.proc.poll() is None and not self.conn.closed:
                send(self.conn, ("close", ()))
        with contextlib.suppress(OSError):
            self.conn.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=0.0 if self.failed else _STOP_GRACE_S)
        self.reaper.kill()
        if not self.failed:
            self.log_path.unlink(missing_ok=True)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --- the process (vLLM's environment) ------------------------------------------------------------


def serve(conn: Connection, engine_kwargs: Mapping[str, Any]) -> None:
    """Build the engine, say READY, then answer queries until `close` (or the trainer's end closes).
    A failure is answered ("error", its line) and raised."""
    try:
        from adapters.vllm.client import ExtensionWorkers, LlmGreedy, LlmLogProbs

        workers = ExtensionWorkers.launch(**engine_kwargs)
    except Exception as err:
        traceback.print_exc()
        send(conn, ("error", f"{type(err).__name__}: {err}"))
        raise
    answers: dict[str, Callable[..., Any]] = {
        "rpc": lambda method, plain: workers.llm.collective_rpc(method, args=(plain,)),
        "log_probs": lambda rows: LlmLogProbs(workers.llm)(torch.tensor(rows))[0].tolist(),
        "greedy": LlmGreedy(workers.llm)}
    try:
        send(conn, ("ok", READY))
        while True:
            op, args = recv(conn)
            if op == "close":
                return
            try:
                value = answers[op](*args)
            except Exception as err:
                traceback.print_exc()
                send(conn, ("error", f"{type(err).__name__}: {err}"))
                raise
            send(conn, ("ok", value))
    finally:
        workers.close()


def main(fd: int, log_path: str) -> int:
    conn = Connection(fd)
    try:
        serve(conn, recv(conn))
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the trainer is gone: so is what it would read
        with contextlib.suppress(OSError):
            os.unlink(log_path)
        return 0
    except Exception:
        traceback.print_exc()  # the log keeps where it was raised
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2]))
