"""rl-refit's vLLM worker extension: the receiving end of a refit, inside every vLLM worker.

Start the engine with `worker_extension_cls="adapters.vllm.extension.RefitWorkerExtension"`
(protocol.EXTENSION); vLLM mixes the class into its worker class, and `LLM.collective_rpc`
calls its methods by name. Each RPC is declared once, as a request record of
adapters.vllm.protocol (its method name, its reply, who may send it); `serves` derives the
extension's method from it, and the handler `_rl_refit_on_<name>` does the work. A method takes
its request and answers its reply record, or an ErrorReply for what it raised, as plain values:
with vLLM's multiprocess engine (the default) collective_rpc arguments cross msgpack, where a
tensor arrives as `[dtype, shape, buffer]` and its data is lost, and an error as text. (Every
name starts with `rl_refit_`: vLLM refuses an extension whose names its worker already has.)

Two ways in:
- colocated (trainer and engine in one process, `VLLM_ENABLE_V1_MULTIPROCESSING=0`):
  `rl_refit_begin`, `rl_refit_load(Load)` with a bucket's tensors by reference, `rl_refit_finalize`;
- a server (the user's, or one rl-refit started): rl-refit's weight-transfer backend
  (adapters.vllm.transfer_backend) receives the buckets through rl-refit's transport, and its
  session's steps go through this class's hooks; `rl_refit_info`, `rl_refit_report`,
  `rl_refit_restore` and `rl_refit_commit` carry what vLLM's routes cannot.

Either way the buckets go through WorkerRefit: vLLM's layerwise reload, the expert redo, the
written/unwritten count and the KV-cache scale reset.
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import attrs
import structlog
import torch

from adapters.vllm import protocol as p
from adapters.vllm.hooks import VllmHooks
from adapters.vllm.protocol import answer
from adapters.vllm.session import WorkerSession
from adapters.vllm.worker import KV_SCALE_NAMES, FinalizeStats, WorkerRefit
from domain.refit.storage import weight_digest

log = structlog.get_logger()

_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile-data permission in this process (x86-64 only; True when granted).

    vLLM's CPU kernels run AMX instructions on short prompts without asking for it first, and
    the worker then dies with SIGILL on its first request when that request has fewer than 5
    tokens; the oneDNN path used for longer ones asks. Asking once at start is harmless.
    """
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


E = TypeVar("E", bound=type)


def serves(*requests: type[p.Request[Any]]) -> Callable[[E], E]:
    """Class decorator: for each request record, the RPC method vLLM's `collective_rpc` calls by
    its name (`METHOD`). Each takes the request as plain values (a JSON string over HTTP) and
    answers with its reply record, or the ErrorReply of what it raised (`_rl_refit_answer`): the
    record is the only place a worker call is declared."""
    def add(cls: E) -> E:
        for kind in requests:
            setattr(cls, kind.METHOD, _rpc(kind))
        return cls

    return add


def _rpc(kind: type[p.Request[Any]]) -> Callable[[Any, Any], dict[str, Any]]:
    def rpc(self: RefitWorkerExtension, request: Any) -> dict[str, Any]:
        return self._rl_refit_answer(kind, request)

    rpc.__name__ = rpc.__qualname__ = kind.METHOD
    rpc.__doc__ = f"Answer {kind.__name__} with {kind.handler()} (adapters.vllm.protocol).\n\n{kind.__doc__ or ''}"
    return rpc


@serves(*p.WORKER_REQUESTS)
class RefitWorkerExtension:
    """Methods vLLM mixes into its worker class; `self` is vLLM's worker. Its RPC methods
    (`rl_refit_*`) are derived from the protocol's records (`serves`); what each does is its
    handler, `_rl_refit_on_*`."""

    # --- the worker's refit state -------------------------------------------------------------

    def _rl_refit_session(self) -> WorkerSession | None:
        """The session of the rl_refit weight-transfer backend, when the server runs it; its refit
        steps go through this extension's hooks (`_rl_refit_on_begin`, `_rl_refit_load_named`,
        ...), so that a subclass sees them whichever way the refit came."""
        engine = getattr(self, "weight_transfer_engine", None)
        session = getattr(engine, "session", None)
        if not isinstance(session, WorkerSession):
            return None
        if session.steps is None:
            session.steps = ExtensionSteps(self)
        return session

    def _rl_refit_state(self) -> WorkerRefit:
        session = self._rl_refit_session()
        if session is not None:  # one WorkerRefit per worker, whichever way the refit came
            return session.refit
        refit = getattr(self, "_rl_refit", None)
        if refit is None:
            request_amx_permission()
            refit = WorkerRefit(
                model=self.model_runner.get_model(),  # type: ignore[attr-defined]
                model_config=self.vllm_config.model_config,  # type: ignore[attr-defined]
                hooks=VllmHooks.from_vllm(),
            )
            self._rl_refit = refit
        return refit

    def _rl_refit_context(self) -> AbstractContextManager[object]:
        from vllm.config import set_current_vllm_config

        return set_current_vllm_config(self.vllm_config)  # type: ignore[attr-defined]

    def _rl_refit_load_named(self, named_tensors: list[tuple[str, torch.Tensor]], retained: bool = False) -> int:
        """Load one bucket's tensors, however they arrived (tests override this to fail or corrupt
        inside the receiver); `retained`: they stay valid until the refit ends (no copy)."""
        return self._rl_refit_state().load(named_tensors, retained)

    def _rl_refit_answer(self, kind: type[p.Request[Any]], request: Any) -> dict[str, Any]:
        """One RPC: the request's access checked (protocol.Access: on a server, a request that
        changes the worker must carry the session's token, SessionRefused otherwise; in-process
        there is nothing to check), then its handler's reply, as plain values (protocol.answer)."""
        def run(record: Any) -> p.Record:
            if kind.ACCESS is not p.Access.READ:
                session = (self._rl_refit_required_session() if kind.ACCESS is p.Access.SESSION
                           else self._rl_refit_session())
                if session is not None:
                    session.check(p.token_of(request))
            return getattr(self, kind.handler())(record)

        return answer(kind, request, run)

    def _rl_refit_required_session(self) -> WorkerSession:
        session = self._rl_refit_session()
        if session is None:
            from domain.errors import ServerMismatch

            raise ServerMismatch("this vLLM server was not started with rl-refit's weight-transfer backend: "
                                 "start it with --weight-transfer-config '{\"backend\": \"rl_refit\"}'")
        return session

    # --- what each request does (subclasses override these) ------------------------------------------

    def _rl_refit_on_delta_base(self, _: p.DeltaBaseQuery) -> p.DeltaBaseReply:
        """The worker's delta receiver: its copy's digest, host bytes, last patch's seconds (the
        first call turns it on)."""
        return p.DeltaBaseReply.of(self._rl_refit_state().delta_base())

    def _rl_refit_on_fingerprint(self, _: p.Fingerprint) -> p.FingerprintReply:
        return p.FingerprintReply.of(self._rl_refit_state().fingerprint())

    def _rl_refit_on_digests(self, _: p.Digests) -> p.DigestsReply:
        """sha256 of every parameter and buffer (to compare engines bit for bit)."""
        return p.DigestsReply(weight_digests(self._rl_refit_state()))

    def _rl_refit_on_live_weights(self, _: p.LiveWeights) -> p.LiveWeightsReply:
        """Every parameter and buffer as [dtype, shape, bytes]."""
        return p.LiveWeightsReply.of(self._rl_refit_state().live_weights())

    def _rl_refit_on_kv_scales(self, _: p.KvScales) -> p.KvScalesReply:
        """Each attention layer's q/k/v/prob scale buffers (`_q_scale`, ...), by module name."""
        return p.KvScalesReply(kv_scales(self._rl_refit_state().model))

    def _rl_refit_on_info(self, _: p.Info) -> p.InfoReply:
        """What this worker is: rl-refit's version, the backend, the world, the model."""
        from adapters.vllm.session import rl_refit_version

        config = self.vllm_config  # type: ignore[attr-defined]
        model = config.model_config
        load = getattr(getattr(config, "load_config", None), "load_format", "auto")
        weights = "dummy" if str(getattr(load, "value", load)) == "dummy" else "checkpoint"
        from adapters.engine_overrides import quantization_scheme

        scheme = quantization_scheme(getattr(getattr(model, "hf_config", None), "quantization_config", None))
        cache = getattr(getattr(config, "cache_config", None), "cache_dtype", "auto")
        return p.InfoReply(rl_refit_version(), self._rl_refit_session() is not None, int(getattr(self, "rank", 0)),
                           int(config.parallel_config.world_size), str(model.model),
                           getattr(model, "quantization", None), weights, str(self._rl_refit_state().device),
                           scheme, str(cache))

    def _rl_refit_on_report(self, _: p.Report) -> p.ReportReply:
        """The session's last refit: its finalize report, its error, whether the worker is stale."""
        session = self._rl_refit_required_session()
        report = None if session.report is None else p.FinalizeReply(**session.report._asdict()).to_plain()
        error = None if session.error is None else p.ErrorReply.of(session.error).to_plain()
        return p.ReportReply(report, error, session.stale_reason, session.restores, session.phase.value)

    def _rl_refit_on_restore(self, request: p.Restore) -> p.Restored:
        """Put the previous weights back; ends vLLM's weight update in progress. (The caller's
        token was checked (Access.SESSION): the session acts under its own.)"""
        session = self._rl_refit_required_session()
        self._weight_update_active = False  # vLLM's worker: its weight update ends here
        with self._rl_refit_context():
            return p.Restored(session.restore(session.token, request.reason))

    def _rl_refit_on_commit(self, _: p.Commit) -> p.Record:
        """The trainer accepted the finalized refit."""
        session = self._rl_refit_required_session()
        session.commit(session.token)
        return p.Done()

    def _rl_refit_on_lora_stage(self, request: p.LoraStage) -> p.LoraStaged:
        """Build a LoRA adapter from the tensors sent, under the id given (held, not served)."""
        from adapters.vllm.lora import stage, worker_manager

        with self._rl_refit_context():
            return p.LoraStaged(stage(worker_manager(self), request.adapter_id, request.config, request.tensors))

    def _rl_refit_on_lora_drop(self, request: p.LoraDrop) -> p.Record:
        """Drop a held LoRA adapter (nothing when none has the id)."""
        from adapters.vllm.lora import drop, worker_manager

        drop(worker_manager(self), request.adapter_id)
        return p.Done()

    def _rl_refit_on_begin(self, _: p.Begin) -> p.Record:
        with self._rl_refit_context():
            self._rl_refit_state().begin()
        return p.Done()

    def _rl_refit_on_load(self, request: p.Load) -> p.Loaded:
        """Colocated: one bucket's tensors, by reference (copied before this returns unless the
        request says they are retained)."""
        with self._rl_refit_context():
            return p.Loaded(self._rl_refit_load_named(list(request.tensors), request.retained))

    def _rl_refit_on_finalize(self, request: p.Finalize) -> p.FinalizeReply:
        with self._rl_refit_context():
            refit = self._rl_refit_state()
            refit.reset_kv_scales = request.reset_kv_scales
            return p.FinalizeReply(**refit.finalize()._asdict())

    def _rl_refit_on_abort(self, _: p.Abort) -> p.Record:
        with self._rl_refit_context():
            self._rl_refit_state().abort()
        return p.Done()

class ExtensionSteps:
    """A session's refit steps (adapters.vllm.session.RefitSteps) through the extension's hooks."""

    def __init__(self, worker: RefitWorkerExtension) -> None:
        self.worker = worker

    def begin(self) -> None:
        self.worker._rl_refit_on_begin(p.Begin())

    def load(self, named_tensors: list[tuple[str, torch.Tensor]], retained: bool = False) -> int:
        return self.worker._rl_refit_load_named(named_tensors, retained)

    def finalize(self) -> FinalizeStats:
        refit = self.worker._rl_refit_state()
        reply = self.worker._rl_refit_on_finalize(p.Finalize(refit.reset_kv_scales))
        return FinalizeStats(**{f.name: getattr(reply, f.name) for f in attrs.fields(p.FinalizeReply)})

    def abort(self) -> None:
        self.worker._rl_refit_on_abort(p.Abort())


def weight_digests(refit: WorkerRefit) -> dict[str, str]:
    """sha256 of every parameter and buffer of a worker's model (UNREADABLE for a weight vLLM
    keeps packed outside its emptied parameter: nothing to compare there)."""
    return {n: weight_digest(t) for n, t in refit.live_weights().items()}


def kv_scales(model: torch.nn.Module) -> dict[str, list[float]]:
    """Each attention layer's q/k/v/prob scale buffers (`_q_scale`, ...), by module name."""
    out: dict[str, list[float]] = {}
    for name, module in model.named_modules():
        values = [getattr(module, f"_{s}", None) for s in KV_SCALE_NAMES]
        if all(isinstance(v, torch.Tensor) for v in values):
            out[name] = [float(v.item()) for v in values]  # type: ignore[union-attr]
    return out
