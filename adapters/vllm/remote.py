"""A vLLM engine in processes of its own, driven from the trainer's process (disaggregated shape).

`EngineProcess` starts the engine host (adapters.vllm.server) with another Python (the one vLLM is
installed in), waits until it has started its engine and connected back, and sends it requests.
`RemoteWorkers` is the VllmWorkers port over it: control through the host's `collective_rpc`,
bucket data through a shared-memory ring the workers map once (adapters.distributed.shm_transport:
the engine host runs on this host), or over a side process group they join once
(adapters.distributed.side_group: gloo on CPU, NCCL on GPU); each refit's buckets are one stream of
that transport, which the workers receive and load themselves (adapters.vllm.extension).

The trainer's `load_bucket` hands its bucket to a sender thread and returns once the bucket is
on the wire (the bucket's buffer is then free to reuse); a failure on either side ends the
stream with an ABORT the workers see, and the engine is marked stale by VllmRolloutEngine.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import structlog
import torch

from adapters.distributed.launch import listen_socket
from adapters.vllm.control import (
    CallWorkers,
    Channel,
    Hello,
    HostGreedy,
    HostLogProbs,
    HostRequest,
    ResetPrefixCache,
    Shutdown,
)
from adapters.vllm.errors import EngineProcessError
from adapters.vllm.lora import LoraServing
from adapters.vllm.protocol import (
    TAG,
    Abort,
    Begin,
    ErrorReply,
    Finalize,
    FinalizeReply,
    Join,
    Leave,
    R,
    ReadyReply,
    Receive,
    Record,
    Request,
    WorkerQueries,
    replies_of,
    reply_of,
)
from domain import errors
from domain.refit.buckets import Bucket
from domain.refit.delta_sync import DeltaBase

log = structlog.get_logger()

_WRAPPERS = ("initialization failed", "See root cause", "See stack trace", "Worker failed with error")
# "(EngineCore pid=12) ERROR 12-02 01:16:29 [core.py:953] " before each line vLLM's processes log
_LOG_PREFIX = re.compile(r"^\((?P<proc>[^)]*)\)\s+(?:[A-Z]+\s+\d\d-\d\d \d\d:\d\d:\d\d\s+\[(?P<where>[^\]]*)\]\s?)?")
_CAUSE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception)(?:\[[^\]]*\])?: ")
_NOT_MESSAGE = ("Traceback", "File ", "The above exception", "During handling", "^")
_CONTINUATION_LINES = 8


def root_cause(text: str) -> str | None:
    """The first exception line of an engine's log that is not one of vLLM's wrappers ("Engine
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


def _diagnosis(path: Path, fallback: str = "") -> str:
    """What went wrong, in one line: the log's root cause (else `fallback`), then the log's path."""
    try:
        cause = root_cause(path.read_text(errors="replace"))
    except OSError:
        cause = None
    if cause is None and fallback.strip():
        cause = fallback.strip().splitlines()[0]
    return f"{cause}; engine log: {path}" if cause else f"engine log: {path}"


@attrs.define
class EngineProcess:
    """The engine host process and its control connection.

    Attributes:
        proc: the host process.
        channel: the control connection.
        log_path: where the host's (and vLLM's) output goes.
        workers: what each worker reported when it started.
        timeout_s: bound on each request's reply (a refit stream's receive included).
    """

    proc: subprocess.Popen[bytes]
    channel: Channel
    log_path: Path
    workers: list[ReadyReply]
    timeout_s: float = 600.0
    reaper: _Reaper | None = None
    _pending: collections.deque[type[Record]] = attrs.field(init=False, factory=collections.deque)
    _failed: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        if self.reaper is None:
            self.reaper = _Reaper(self.proc)

    @classmethod
    def start(cls, python: str, engine_kwargs: Mapping[str, Any], *, env: Mapping[str, str] | None = None,
              host: str = "127.0.0.1", start_timeout_s: float = 600.0, timeout_s: float = 600.0,
              log_path: str | Path | None = None, notify: Callable[[str], None] | None = None) -> EngineProcess:
        """Start the host and wait until its engine serves.

        Args:
            python: the interpreter to run the host with (vLLM and rl-refit installed).
            engine_kwargs: `vllm.LLM(**engine_kwargs)` (plain JSON values).
            env: the host's environment (default: this process's).
            host: the address the trainer listens on for the host's connection.
            start_timeout_s: bound on the engine's start.
            timeout_s: bound on each later request.
            log_path: the host's output (default: a file in the temporary directory).
            notify: told every 30 s that the host has not connected yet (default: a line on
                stderr), so that a slow start is never silence.

        Returns:
            The running EngineProcess. Raises EngineProcessError (with the end of the host's log)
            when the host exits, fails to start its engine or does not connect in time.
        """
        listener = listen_socket(host)
        token = secrets.token_hex(16)
        # vLLM's IPC sockets (and any other temporary file of its processes) go into a directory of
        # this engine's own, removed with it, instead of piling up in the temp directory
        private = tempfile.mkdtemp(prefix="rl-refit-vllm-")
        spec = {"engine_kwargs": dict(engine_kwargs), "trainer_host": host,
                "trainer_port": listener.getsockname()[1], "token": token, "private_dir": private}
        fd, spec_path = tempfile.mkstemp(prefix="rl-refit-engine-", suffix=".json")
        with os.fdopen(fd, "w") as f:  # mode 0600: the token stays private
            json.dump(spec, f)
        out = Path(log_path) if log_path is not None else Path(tempfile.mkstemp(prefix="rl-refit-engine-", suffix=".log")[1])
        with out.open("wb") as logf:
            proc = subprocess.Popen([python, "-m", "adapters.vllm.server", spec_path], stdout=logf,
                                    stderr=subprocess.STDOUT, env=dict(env) if env is not None else None,
                                    start_new_session=True)
        reaper = _Reaper(proc, Path(private))
        try:
            channel = cls._accept(listener, proc, out, start_timeout_s, notify or _say)
            message = channel.receive(start_timeout_s)
        except BaseException:  # Ctrl-C, SIGTERM, a timeout: nothing of the engine is left running
            reaper.kill()
            raise
        finally:
            listener.close()
            Path(spec_path).unlink(missing_ok=True)
        try:
            hello = Hello.from_plain(message)
        except errors.WireProtocolError:
            hello = None
        if hello is None or hello.token != token:
            reaper.kill()
            raise EngineProcessError("a process that is not the engine host connected to the trainer's control port")
        if hello.error is not None:
            reaper.stop(30.0)
            failure = ErrorReply.from_plain(hello.error)
            raise EngineProcessError(
                f"the vLLM engine failed to start: {_diagnosis(out, f'{failure.type}: {failure.message}')}")
        workers = [ReadyReply.from_plain(w) for w in hello.workers]
        log.info("vllm engine host started", pid=hello.pid, workers=len(workers), log=str(out))
        return cls(proc, channel, out, workers, timeout_s, reaper)

    @staticmethod
    def _accept(listener: Any, proc: subprocess.Popen[bytes], out: Path, timeout_s: float,
                notify: Callable[[str], None]) -> Channel:
        start = time.monotonic()
        said = 0.0
        listener.settimeout(1.0)
        while True:
            try:
                sock, _ = listener.accept()
                return Channel(sock, f"the vLLM engine host (pid {proc.pid})")
            except TimeoutError:
                pass
            if proc.poll() is not None:
                raise EngineProcessError(f"the vLLM engine host (pid {proc.pid}) {_ended(proc)} before it "
                                         f"connected: {_diagnosis(out)}")
            waited = time.monotonic() - start
            if waited > timeout_s:
                raise EngineProcessError(
                    f"the vLLM engine host (pid {proc.pid}) did not connect within {timeout_s:g} s "
                    f"(rollout.engine_kwargs.vllm.start_timeout_s) and was killed, with its engine processes: "
                    f"{_diagnosis(out)}")
            if waited - said >= _PROGRESS_EVERY_S:
                said = waited
                notify(f"waiting for the vLLM engine host (pid {proc.pid}) to start: {waited:.0f} s of "
                       f"{timeout_s:g} s (rollout.engine_kwargs.vllm.start_timeout_s); its log: {out}")

    # --- requests ------------------------------------------------------------------------------

    def send(self, request: HostRequest[Any]) -> None:
        """Send a request whose reply `reply()` reads later."""
        if self.proc.poll() is not None:
            raise self._died()
        self.channel.send(request.to_plain())
        self._pending.append(request.REPLY)

    def reply(self, timeout_s: float | None = None) -> Record:
        """The reply to the oldest request sent; raises what the host (or a worker) raised, as its
        own class."""
        kind = self._pending.popleft()
        try:
            message = self.channel.receive(self.timeout_s if timeout_s is None else timeout_s)
        except EngineProcessError as err:
            self._failed = True
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=_EXIT_GRACE_S)  # a host that died mid-request: name how
            if self.proc.poll() is not None:
                raise self._died() from None
            raise EngineProcessError(f"{err}: {_diagnosis(self.log_path)}") from None
        if message.get(TAG) == ErrorReply.__name__:
            self._failed = True  # the log is kept: errors name it
            raise ErrorReply.from_plain(message).rebuild()
        return kind.from_plain(message)

    def call(self, request: HostRequest[R]) -> R:
        """The host's reply to `request`."""
        self.send(request)
        return self.reply()  # type: ignore[return-value]

    def workers_call(self, request: Request[R]) -> list[R]:
        """Every worker's reply to a worker request; raises a worker's error as its own class (and
        keeps the engine's log after close: errors name it)."""
        try:
            return replies_of(request, self.call(CallWorkers(request.METHOD, request.to_plain())).answers)
        except Exception:
            self._failed = True
            raise

    def workers_reply(self, request: Request[R]) -> R:
        """The first worker's reply to `request`, sent earlier with `send(CallWorkers(...))`; as
        `workers_call`, a worker's error is raised as its own class and keeps the log."""
        try:
            return reply_of(request, self.reply().answers)  # type: ignore[attr-defined]
        except Exception:
            self._failed = True
            raise

    def drain(self) -> None:
        """Read and drop the replies still owed (after a failure)."""
        while self._pending:
            try:
                self.reply()
            except Exception as err:  # a worker's own error crosses as its own class, builtins included
                log.debug("dropped a failed reply", error=str(err)[:200])
                if isinstance(err, EngineProcessError):
                    self._pending.clear()

    def _died(self) -> EngineProcessError:
        """The error for a host that is gone; its engine processes are killed with it."""
        self._failed = True
        assert self.reaper is not None
        self.reaper.kill()
        return EngineProcessError(f"the vLLM engine host (pid {self.proc.pid}) {_ended(self.proc)}; its engine "
                                  f"processes were stopped: {_diagnosis(self.log_path)}")

    def close(self, timeout_s: float = 60.0) -> None:
        """Shut the engine down: ask the host, wait for it (killed past `timeout_s`), then kill
        whatever is left of its process group and remove its private temporary directory. The log
        is removed after a clean run and kept (errors name it) after any failure: a request or a
        worker that raised, a host that died."""
        clean = False
        if self.proc.poll() is None:
            try:
                self.drain()
                self.call(Shutdown())
                clean = not self._failed
            except Exception:  # the host is stopped below whatever it answered
                pass
        self.channel.close()
        assert self.reaper is not None
        self.reaper.stop(timeout_s)
        if clean and self.proc.returncode == 0:
            self.log_path.unlink(missing_ok=True)


_PROGRESS_EVERY_S = 30.0


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
_EXIT_GRACE_S = 2.0


def _ended(proc: subprocess.Popen[bytes]) -> str:
    """How a finished process ended, in words: "was killed by SIGKILL", "exited with status 1"."""
    code = proc.returncode
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


@attrs.define
class _Reaper:
    """Stops an engine host and every process of its group: vLLM's engine core, its workers and
    their resource tracker, which outlive a host killed from outside; then removes the engine's
    private temporary directory (vLLM's IPC sockets). The host is started as a
    session leader, so its group id is its pid. Registered at exit, so that a trainer that ends
    any other way leaves none of them behind."""

    proc: subprocess.Popen[bytes]
    private_dir: Path | None = None  # the engine's own temporary directory, removed once it is gone
    _done: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        atexit.register(self.kill)

    def stop(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the host to exit by itself, then kill the group."""
        if self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout_s)
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


_END = object()


@attrs.define
class _Stream:
    """One refit's bucket stream: a sender thread runs the transport, fed one bucket at a time."""

    transport: Any
    _inbox: queue.Queue[Any] = attrs.field(init=False, factory=lambda: queue.Queue(maxsize=1))
    _acks: queue.Queue[int] = attrs.field(init=False, factory=queue.Queue)
    _error: BaseException | None = attrs.field(init=False, default=None)
    _thread: threading.Thread = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rl-refit-bucket-sender", daemon=True)
        self._thread.start()

    def _buckets(self) -> Iterator[Bucket]:
        while True:
            item = self._inbox.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            self._acks.put(item.index)  # with one bucket in flight, resuming means it is on the wire

    def _run(self) -> None:
        try:
            self.transport.send(self._buckets())
        except BaseException as err:
            self._error = err
        finally:
            self._acks.put(-1)  # wakes a waiting put()

    def put(self, bucket: Bucket) -> None:
        """Send one bucket; returns when it is on the wire (its buffer may then be reused)."""
        self._raise()
        self._inbox.put(bucket)
        self._acks.get()
        self._raise()

    def close(self, failure: BaseException | None = None) -> None:
        """End the stream (END, or ABORT with `failure`) and wait for the sender."""
        if self._thread.is_alive():
            with contextlib.suppress(queue.Full):
                self._inbox.put(_END if failure is None else failure, timeout=self.transport.timeout_s)
            self._thread.join(self.transport.timeout_s + 5.0)
        if failure is None:
            self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error


@attrs.define
class RemoteWorkers(WorkerQueries):
    """The refit steps on the workers of an engine host (VllmWorkers).

    Attributes:
        process: the engine host.
        bucket_bytes: the bucket capacity (the workers' receive buffers).
        host: the address the side group's store listens on.
        backend: how the buckets travel: "shm" (a shared-memory ring: the engine host runs on this
            host), "gloo" (a side process group, CPU) or "nccl" (GPU).
        timeout_s: bound on joining and on every wait of a stream.
        slot_bytes: shm: bytes of each of the ring's slots (at most a bucket).
    """

    process: EngineProcess
    bucket_bytes: int
    host: str = "127.0.0.1"
    backend: str = "shm"
    timeout_s: float = 120.0
    slot_bytes: int = 32 << 20
    _transport: Any = attrs.field(init=False, default=None)
    _link: Any = attrs.field(init=False, default=None)  # what close() closes: the side group, or the ring's transport
    _stream: _Stream | None = attrs.field(init=False, default=None)
    _refits: int = attrs.field(init=False, default=0)
    _delta: bool = attrs.field(init=False, default=False)  # delta refits: each stream's layout may differ

    def call_all(self, request: Request[R]) -> list[R]:
        """Every worker's reply to `request`; raises a worker's error as its own class."""
        return self.process.workers_call(request)

    def _join(self) -> None:
        if self.backend == "shm":
            self._join_ring()
            return
        from adapters.distributed.side_group import SideGroup
        from adapters.distributed.transport import TorchDistTransport

        rv, store = SideGroup.serve(self.host, 1 + len(self.process.workers), backend=self.backend,
                                    timeout_s=self.timeout_s)
        join = Join(rv.to_dict(), self.bucket_bytes, self.timeout_s)
        self.process.send(CallWorkers(join.METHOD, join.to_plain()))
        group = SideGroup.join(rv, 0, store)  # blocks until every worker has joined
        self.process.workers_reply(join)
        self._link = group
        self._transport = TorchDistTransport(group, source=0, rank=0, peers=group.ranks, bucket_bytes=self.bucket_bytes,
                                             timeout_s=self.timeout_s, window=1, device=group.device)

    def _join_ring(self) -> None:
        """The workers map a shared-memory ring and connect to it; they do not wait for this end
        (its listening socket queues them), so a worker that cannot join answers with its error."""
        from adapters.distributed.shm_transport import ShmSource

        source = ShmSource.serve(len(self.process.workers), slot_bytes=min(self.bucket_bytes, self.slot_bytes),
                                 timeout_s=self.timeout_s)
        try:
            join = Join(source.rendezvous.to_dict(), self.bucket_bytes, self.timeout_s, transport="shm")
            self.process.send(CallWorkers(join.METHOD, join.to_plain()))
            self.process.workers_reply(join)
        except BaseException:
            source.close()
            raise
        self._transport = self._link = source.accept()

    def begin(self) -> None:
        self.call(Begin())
        if self._transport is None:
            self._join()
        self._refits += 1
        self._transport.refit_id = self._refits
        if self._delta:
            self._transport.forget_layout()
        receive = Receive(self._refits, relearn=self._delta)
        self.process.send(CallWorkers(receive.METHOD, receive.to_plain()))  # answered at the stream's end
        self._stream = _Stream(self._transport)

    def load(self, bucket: Bucket) -> int:
        if self._stream is None:
            raise errors.RefitLifecycleError("load before begin: call begin() first")
        self._stream.put(bucket)
        return len(bucket.metas)

    def finalize(self, reset_kv_scales: bool) -> FinalizeReply:
        stream, self._stream = self._stream, None
        if stream is None:
            raise errors.RefitLifecycleError("finalize before begin: call begin() first")
        try:
            stream.close()
        finally:
            # the workers' receive: raises what a worker raised
            self.process.workers_reply(Receive(self._refits))
        return self.call(Finalize(reset_kv_scales))

    def abort(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close(errors.TransportAborted("the trainer aborted the refit"))
        self.process.drain()  # the workers' receive ends with the ABORT
        self.call(Abort())

    def reset_prefix_cache(self) -> None:
        self.process.call(ResetPrefixCache())

    def lora_stage(self, adapter_id: int, config: Mapping[str, Any], tensors: bytes) -> int:
        """As WorkerQueries', over the control channel: the tensors travel base64-encoded (4/3)."""
        super().lora_stage(adapter_id, config, tensors)
        return 4 * -(-len(tensors) // 3)

    def delta_base(self) -> DeltaBase:
        self._delta = True  # from now on every stream carries its metadata
        return super().delta_base()

    def close(self) -> None:
        """Leave the side group and shut the engine down."""
        if self._link is not None:
            with contextlib.suppress(Exception):  # the engine is shut down below either way
                self.call(Leave())
            self._link.close()
            self._link = self._transport = None
        self.process.close()


@attrs.define
class RemoteLogProbs:
    """The engine host's prompt log-probs (VllmRolloutEngine's log_prob_fn); entropy is NaN."""

    process: EngineProcess

    def __call__(self, input_ids: torch.Tensor, temperature: float = 1.0,
                 lora: LoraServing | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.process.call(HostLogProbs(input_ids.tolist(), temperature, _plain(lora))).rows
        logp = torch.tensor([list(row) for row in rows], dtype=torch.float32)
        return logp, torch.full_like(logp, float("nan"))


def _plain(lora: LoraServing | None) -> list[Any] | None:
    return None if lora is None else lora.to_plain()


@attrs.define
class RemoteGreedy:
    """The engine host's greedy continuations (VllmRolloutEngine's greedy_fn)."""

    process: EngineProcess

    def __call__(self, prompts: list[list[int]], max_tokens: int, lora: LoraServing | None = None) -> list[list[int]]:
        tokens = self.process.call(HostGreedy(prompts, max_tokens, _plain(lora))).tokens
        return [list(map(int, p)) for p in tokens]


@attrs.define
class ColdEngine(WorkerQueries):
    """An engine host started from a checkpoint directory, queried as it loaded it (no refit, no
    guard): the reference a refitted engine is compared with (ports.engine_inspection, and its
    prompt log-probs)."""

    process: EngineProcess
    directory: Path

    def placeholders(self, names: Iterable[str]) -> frozenset[str]:
        """The parameters of an activation-scale kind the checkpoint has no tensor of: vLLM creates
        them for the scheme and a weight-only checkpoint leaves them at their load-time values."""
        from adapters.hf_checkpoint.reader import HfCheckpoint
        from adapters.vllm.worker import activation_scale_kind

        carried = {activation_scale_kind(name) for name, _ in HfCheckpoint(self.directory).tensor_shapes()}
        return frozenset(n for n in names if (kind := activation_scale_kind(n)) is not None and kind not in carried)

    def call_all(self, request: Request[R]) -> list[R]:
        return self.process.workers_call(request)

    def log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        return RemoteLogProbs(self.process)(input_ids)[0]

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return RemoteGreedy(self.process)(prompts, max_tokens)

    def close(self) -> None:
        self.process.close()
