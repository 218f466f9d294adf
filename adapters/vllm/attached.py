"""A vLLM engine rl-refit did not start: the user's server, an AsyncLLM, an offline LLM or a Ray
actor, refitted through vLLM's own control plane (adapters.vllm.controls) and rl-refit's
weight-transfer backend in its workers (adapters.vllm.transfer_backend).

`AttachedWorkers` is the VllmWorkers port over an `EngineControl`:

    begin:    pause generation (keep, by default) -> init the transfer once (the ring, or a side
              group) -> /start_weight_update -> /update_weights in a thread while the buckets stream
    load:     one bucket onto the transport
    finalize: end the stream -> /finish_weight_update -> the workers' report -> reset the prefix
              cache -> resume -> the weight version (`rl-refit-<refit>`)
    abort:    end the stream with ABORT -> the workers restore their previous weights -> resume

Generation is paused around every refit, never optionally: a request that reaches vLLM in the
middle of a layerwise reload kills its engine core. A refit the workers could not restore from
leaves the server paused and the engine stale, and says so.

Every worker call carries the session token the workers took at init; only this trainer can drive
its refits (docs/attach.md).
"""

from __future__ import annotations

import contextlib
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import structlog
import torch

from adapters.engine_start import same_model
from adapters.vllm.controls import PAUSE_MODES, EngineControl
from adapters.vllm.engine import Aborted
from adapters.vllm.protocol import (
    ErrorReply,
    FinalizeReply,
    Info,
    InfoReply,
    R,
    Report,
    ReportReply,
    Request,
    Restore,
    WorkerQueries,
    replies_of,
    with_token,
)
from adapters.vllm.session import rl_refit_version
from domain import errors
from domain.errors import ServerMismatch
from domain.refit.buckets import Bucket

log = structlog.get_logger()

VERSION_PREFIX = "rl-refit-"
_RESET_TRIES = 20


@attrs.frozen
class Expected:
    """What the configuration says the server is: checked by `probe` before the first refit.

    Attributes:
        model: the model path or name it should serve (None: not checked).
        quantization: vLLM's `quantization` method the plan needs (None: BF16).
        server_flags: the flags that start a server for this plan (said when it differs).
        scheme: what the plan's quantization config makes of the weights and activations, in
            adapters.engine_overrides.quantization_scheme's words (None: not checked).
        kv_cache_dtype: the KV cache's dtype the configuration asks for (None: not checked).
    """

    model: str | None = None
    quantization: str | None = None
    server_flags: str = ""
    scheme: str | None = None  # adapters.engine_overrides.quantization_scheme of the plan's config (None: not checked)
    kv_cache_dtype: str | None = None  # None: not checked


def probe(control: EngineControl, expected: Expected) -> list[InfoReply]:
    """Every worker's InfoReply, after checking the server is one rl-refit can refit for this
    configuration; ServerMismatch (one line: what differs and what to do) otherwise."""
    try:
        answers = control.collective_rpc(Info.METHOD, Info().to_plain())
    except errors.EngineUpdateFailed as err:
        if "rl_refit_info" in str(err) or "has no attribute" in str(err):
            raise ServerMismatch(f"{control.where} runs without rl-refit's worker extension: start it with "
                                 "--worker-extension-cls adapters.vllm.extension.RefitWorkerExtension") from None
        raise
    infos = replies_of(Info(), answers)
    mine = rl_refit_version()
    for info in infos:
        if not info.backend:
            raise ServerMismatch(f"{control.where} runs without rl-refit's weight-transfer backend: start it with "
                                 "--weight-transfer-config '{\"backend\": \"rl_refit\"}'")
        if info.version != mine:
            raise ServerMismatch(f"{control.where} runs rl-refit {info.version}, this trainer {mine}: install the "
                                 "same rl-refit version on both sides")
    first = infos[0]
    if expected.model is not None and not same_model(first.model, expected.model):
        raise ServerMismatch(f"{control.where} serves {first.model!r}, not {expected.model!r} (model.path): attach to "
                             "the server of this model, or set model.path to the served one")
    if not same_method(first.quantization, expected.quantization):
        flags = f" ({expected.server_flags})" if expected.server_flags else ""
        raise ServerMismatch(f"{control.where} was started with quantization={first.quantization!r}, but the plan "
                             f"needs {expected.quantization!r}: restart the server with the plan's flags{flags}, "
                             "or change rollout.quantization to what the server serves")
    if expected.scheme is not None and first.scheme != expected.scheme:
        flags = f" ({expected.server_flags})" if expected.server_flags else ""
        raise ServerMismatch(f"{control.where} quantizes otherwise than the plan: it serves [{_short(first.scheme)}], "
                             f"the plan needs [{_short(expected.scheme)}]: restart the server from `refit export`'s "
                             f"checkpoint or with the plan's flags{flags}, or change rollout.quantization")
    if expected.kv_cache_dtype is not None and _kv(first.kv_cache_dtype) != _kv(expected.kv_cache_dtype):
        raise ServerMismatch(f"{control.where} keeps its KV cache in {first.kv_cache_dtype}, but "
                             f"rollout.engine_kwargs.vllm.kv_cache_dtype is {expected.kv_cache_dtype}: restart the server "
                             f"with --kv-cache-dtype {expected.kv_cache_dtype}, or set the key to what it serves")
    return infos


def _short(text: str | None, limit: int = 400) -> str:
    text = "none" if text is None else text
    return text if len(text) <= limit else text[:limit] + " ..."


def _kv(dtype: str) -> str:
    return "fp8_e4m3" if dtype == "fp8" else dtype  # vLLM's fp8 is e4m3



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


def same_method(served: str | None, planned: str | None) -> bool:
    """The server's quantization method is the plan's: equal, or the one vLLM resolved it to from
    the checkpoint's config (a `modelopt` request serves NVFP4 weights as `modelopt_fp4`)."""
    served, planned = served or None, planned or None
    if served == planned:
        return True
    return served is not None and planned is not None and served.startswith(planned + "_")


@attrs.define
class _Update:
    """The workers' side of one refit's stream: `update_weights` in a thread (it returns when the
    stream has ended)."""

    call: Callable[[], None]
    error: BaseException | None = attrs.field(init=False, default=None)
    _thread: threading.Thread = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rl-refit-update-weights", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.call()
        except BaseException as err:
            self.error = err

    def wait(self, timeout_s: float) -> BaseException | None:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return errors.CollectiveTimeout(0, "the workers' update_weights", timeout_s)
        return self.error


@attrs.define
class AttachedWorkers(WorkerQueries):
    """The refit steps on the workers of an engine reached through `control` (VllmWorkers).

    Attributes:
        control: the engine's control plane.
        bucket_bytes: the bucket capacity.
        transport: how buckets travel (rollout.engine_kwargs.vllm.transport): shm, gloo, nccl,
            cuda_ipc, or auto (by where the trainer's tensors and the workers live,
            domain.refit.transport_choice).
        pause_mode: how generation pauses around a refit: keep (in-flight requests freeze and
            continue after it), abort or wait.
        reset_running_requests: also drop the KV of requests in flight (their continuation is then
            computed with the new weights: on-policy).
        timeout_s: bound on joining and on every wait of a stream.
        slot_bytes: shm: bytes of each of the ring's slots.
        host: gloo, nccl: the address the side group's store listens on (reachable by the workers).
        token: this trainer's session token (fresh per engine).
    """

    control: EngineControl
    bucket_bytes: int
    transport: str = "shm"
    pause_mode: str = attrs.field(default="keep", validator=attrs.validators.in_(PAUSE_MODES))
    reset_running_requests: bool = False
    timeout_s: float = 120.0
    slot_bytes: int = 32 << 20
    host: str = "127.0.0.1"
    token: str = attrs.field(factory=lambda: secrets.token_hex(16))
    workers: int = 1
    guardian: Any = None  # adapters.vllm.guardian.Guardian: resumes the server if this trainer dies mid-refit
    source_device: str = "cpu"  # where the trainer's tensors live (the transport's choice)
    receiver_device: str = "cpu"  # where the workers' weights live
    transport_used: str | None = attrs.field(init=False, default=None)  # the transport the buckets take
    _link: Any = attrs.field(init=False, default=None)
    _sender: Any = attrs.field(init=False, default=None)
    _stream: Any = attrs.field(init=False, default=None)
    _update: _Update | None = attrs.field(init=False, default=None)
    _refits: int = attrs.field(init=False, default=0)
    _paused: bool = attrs.field(init=False, default=False)
    _delta: bool = attrs.field(init=False, default=False)
    last_report: ReportReply | None = attrs.field(init=False, default=None)

    # --- worker calls -------------------------------------------------------------------------

    def call_all(self, request: Request[R]) -> list[R]:
        """Every worker's reply to `request` (carrying the session token)."""
        return replies_of(request, self.control.collective_rpc(request.METHOD, with_token(request, self.token)))

    def report(self) -> ReportReply:
        """The first worker's session report (its last refit)."""
        self.last_report = self.call(Report())
        return self.last_report

    def _worker_error(self, fallback: BaseException) -> BaseException:
        """The typed error a worker recorded for the refit that just failed (else `fallback`)."""
        try:
            report = self.report()
        except Exception:
            return fallback
        if report.error is None:
            return fallback
        return ErrorReply.from_plain(report.error).rebuild()

    # --- the bracket ----------------------------------------------------------------------------

    def _pause(self) -> None:
        if self.guardian is not None:
            self.guardian.begin()
        self.control.pause(self.pause_mode)
        self._paused = True

    def _resume(self) -> None:
        self.control.resume()
        self._paused = False
        if self.guardian is not None:
            self.guardian.end()

    def _reset_prefix_cache(self) -> None:
        for _ in range(_RESET_TRIES):  # refused while blocks are held (requests in flight): retried
            if self.control.reset_prefix_cache(self.reset_running_requests):
                return
            time.sleep(0.05)
        log.warning("the server kept its prefix cache after a refit", where=self.control.where)

    # --- the refit steps (VllmWorkers) ----------------------------------------------------------

    def _init_transfer(self) -> None:
        """Offer the transport, hand its rendezvous and the session token to every worker (vLLM's
        `init_weight_transfer_engine`, in a thread: a side group's workers wait in it until this
        end joins), and accept them."""
        from adapters.distributed.transports import offer_transport
        from adapters.vllm.session import InitInfo
        from domain.refit.transport_choice import choose_transport

        choice = choose_transport(self.transport, source_device=self.source_device,
                                  receiver_device=self.receiver_device, same_host=self.control.same_host,
                                  config_key="rollout.engine_kwargs.vllm.transport")
        offer = offer_transport(choice.name, self.workers, self.bucket_bytes, timeout_s=self.timeout_s,
                                host=self.host, slot_bytes=self.slot_bytes)
        info = InitInfo(self.token, rl_refit_version(), choice.name, offer.rendezvous, self.bucket_bytes,
                        self.timeout_s)
        init = _Update(lambda: self.control.init_weight_transfer_engine(attrs.asdict(info)))
        try:
            link = offer.accept()
        except BaseException:
            offer.close()
            failed = init.wait(self.timeout_s)
            if failed is not None:  # the workers' own error says why they never joined
                raise self._worker_error(failed) from None
            raise
        failed = init.wait(self.timeout_s)
        if failed is not None:
            link.close()
            raise self._worker_error(failed) from None
        self._link, self._sender, self.transport_used = link, link.transport, choice.name
        log.info("attached: the workers joined the transport", transport=choice.name, reason=choice.reason,
                 workers=self.workers)

    def begin(self) -> None:
        self._pause()
        try:
            if self._sender is None:
                self._init_transfer()
            self.control.start_weight_update()
        except BaseException as err:
            with contextlib.suppress(Exception):
                self._resume()
            raise self._worker_error(err) if isinstance(err, errors.EngineUpdateFailed) else err from None
        self._refits += 1
        refit_id = self._refits
        self._sender.refit_id = refit_id
        if self._delta:
            self._sender.forget_layout()
        update = {"token": self.token, "refit_id": refit_id, "relearn": self._delta}
        self._update = _Update(lambda: self.control.update_weights(update))
        self._stream = _Stream(self._sender)

    def load(self, bucket: Any) -> int:
        if self._stream is None:
            raise errors.RefitLifecycleError("load before begin: call begin() first")
        self._stream.put(bucket)
        return len(bucket.metas)

    def finalize(self, reset_kv_scales: bool) -> FinalizeReply:
        stream, self._stream = self._stream, None
        update, self._update = self._update, None
        if stream is None or update is None:
            raise errors.RefitLifecycleError("finalize before begin: call begin() first")
        try:
            stream.close()
        except BaseException as err:
            update.wait(self.timeout_s)
            raise self._worker_error(err) from None
        failed = update.wait(self.timeout_s + 30.0)
        if failed is not None:
            raise self._worker_error(failed) from None
        try:
            self.control.finish_weight_update(None)
        except errors.EngineUpdateFailed as err:
            raise self._worker_error(err) from None
        report = self.report()
        if report.finalize is None:
            raise errors.WireProtocolError(f"{self.control.where}: the workers finished without a report")
        self._reset_prefix_cache()
        self._resume()
        self.control.set_weight_version(f"{VERSION_PREFIX}{self._refits}")
        stats = FinalizeReply.from_plain(report.finalize)
        return attrs.evolve(stats, kv_scales_reset=stats.kv_scales_reset if reset_kv_scales else 0)

    def abort(self) -> Aborted:
        """End the refit in progress and put the previous weights back; the server serves again
        when they are back, and stays paused when the workers had nothing to restore from (it
        would serve incomplete weights)."""
        stream, self._stream = self._stream, None
        update, self._update = self._update, None
        if stream is not None:
            stream.close(errors.TransportAborted("the trainer aborted the refit"))
        if update is not None:
            update.wait(self.timeout_s)
        return self.restore("the trainer aborted the refit")

    def restore(self, reason: str) -> Aborted:
        """The workers put their previous weights back; the server resumes when they did."""
        if not self._paused:
            self._pause()
        restored = all(r.restored for r in self.call_all(Restore(reason)))
        if restored:
            self._reset_prefix_cache()
            self._resume()
            if self._refits > 1:
                self.control.set_weight_version(f"{VERSION_PREFIX}{self._refits - 1}")
            return Aborted(True)
        why = self.report().stale_reason or "the workers could not restore their previous weights"
        log.error("the attached server could not restore its weights; it stays paused", where=self.control.where,
                  why=why)
        return Aborted(False, f"{why}; {self.control.where} stays paused")

    def reset_prefix_cache(self) -> None:
        return None  # part of finalize: before the server resumes

    def lora_stage(self, adapter_id: int, config: Mapping[str, Any], tensors: bytes) -> int:
        """Through the control's own LoRA path when it has one (a server: vLLM's LoRA routes, the
        adapter's files on this host), else every worker builds it from the tensors sent."""
        stage = getattr(self.control, "stage_lora", None)
        if stage is not None:
            return int(stage(adapter_id, config, tensors))
        return super().lora_stage(adapter_id, config, tensors)

    def lora_drop(self, adapter_id: int) -> None:
        drop = getattr(self.control, "drop_lora", None)
        if drop is not None:
            drop(adapter_id)
            return
        super().lora_drop(adapter_id)

    def delta_base(self) -> Any:
        self._delta = True
        return super().delta_base()

    def close(self) -> None:
        """Let go of the server (it keeps running): end the transport, resume if this trainer paused it."""
        link, self._link, self._sender = self._link, None, None
        if link is not None:
            link.close()
        if self._paused:
            with contextlib.suppress(Exception):
                self._resume()
        if self.guardian is not None:
            self.guardian.close()
        self.control.close()


@attrs.define
class ControlLogProbs:
    """Prompt log-probs through an engine's control plane (VllmRolloutEngine's log_prob_fn)."""

    control: EngineControl

    def __call__(self, input_ids: torch.Tensor, temperature: float = 1.0, lora: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        logp = self.control.log_probs(input_ids, temperature, lora)
        return logp, torch.full_like(logp, float("nan"))


@attrs.define
class ControlGreedy:
    """Greedy continuations through an engine's control plane (VllmRolloutEngine's greedy_fn)."""

    control: EngineControl

    def __call__(self, prompts: list[list[int]], max_tokens: int, lora: Any = None) -> list[list[int]]:
        return self.control.greedy(prompts, max_tokens, lora)


def attach(control: EngineControl, expected: Expected, *, bucket_bytes: int, settings: Mapping[str, Any],
           guard: Callable[[str], Any] | None = None, owned_dirs: tuple[str, ...] = ()) -> Any:
    """A VllmRolloutEngine over the engine `control` reaches, after `probe` checked it.

    Args:
        control: the engine's control plane.
        expected: what the configuration says the server is.
        bucket_bytes: the refit's bucket size.
        settings: AttachedWorkers' options (transport, pause_mode, reset_running_requests, timeout_s).
        guard: starts the guardian of this session from its token (None: no guardian).
        owned_dirs: directories made for this engine, removed when it closes.
    """
    from adapters.vllm.engine import VllmRolloutEngine

    infos = probe(control, expected)
    token = secrets.token_hex(16)
    workers = AttachedWorkers(control, bucket_bytes, workers=len(infos), token=token,
                              guardian=None if guard is None else guard(token),
                              receiver_device=torch.device(infos[0].device).type, **dict(settings))
    return VllmRolloutEngine(workers, log_prob_fn=ControlLogProbs(control), greedy_fn=ControlGreedy(control),
                             restores=True, serves_from_start=infos[0].weights == "checkpoint", owned_dirs=owned_dirs)
