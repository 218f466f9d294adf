"""VllmRolloutEngine: the RolloutEngine port over vLLM's layerwise reload.

The adapter talks to the workers through `VllmWorkers`, one `call(step, *args)` per refit step:
`LocalWorkers` runs a WorkerRefit in this process (fakes, tests, an in-process engine),
`LlmWorkers` runs it inside every vLLM worker through `LLM.collective_rpc`.

Commit mode PER_LAYER: vLLM processes and commits each layer as soon as its tensors are in and
keeps no copy of the old weights, so a failure cannot be rolled back: the engine is marked
stale and refuses to serve until a full refit succeeds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Protocol

import attrs
import structlog
import torch

from adapters.vllm.hooks import PINNED_VLLM
from adapters.vllm.worker import WorkerRefit
from domain.errors import EngineBusy, EngineStale, StorageRebound
from domain.refit.buckets import Bucket, unpack_bucket
from domain.refit.engine_layout import Layout, check_bucket
from domain.refit.report import EngineFinalizeResult
from domain.refit.session import CommitMode, RefitSession
from domain.refit.storage import StorageFingerprint

log = structlog.get_logger()

LogProbFn = Callable[[torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]


class VllmWorkers(Protocol):
    """Runs one refit step on every worker; returns the first worker's result."""

    def call(self, step: str, *args: Any) -> Any: ...


@attrs.define
class LocalWorkers:
    """The refit steps on a WorkerRefit in this process."""

    refit: WorkerRefit

    def call(self, step: str, *args: Any) -> Any:
        if step == "finalize":
            self.refit.reset_kv_scales = bool(args[0])
            return self.refit.finalize()
        return getattr(self.refit, step)(*args)


@attrs.define
class LlmWorkers:
    """The refit steps inside every worker of a `vllm.LLM`, through `LLM.collective_rpc`.

    Out-of-process workers receive callables by serialization: start the engine with
    `VLLM_ALLOW_INSECURE_SERIALIZATION=1` (engine_args.vllm_environment sets it).
    """

    llm: Any

    @classmethod
    def launch(cls, **engine_kwargs: Any) -> LlmWorkers:
        """Start `vllm.LLM(**engine_kwargs)` (see engine_args.vllm_engine_kwargs; apply
        engine_args.vllm_environment first). Raises ModuleNotFoundError naming the adapter
        when vllm is not installed."""
        try:
            from vllm import LLM
        except ModuleNotFoundError as err:
            if err.name is None or not err.name.startswith("vllm"):
                raise
            raise ModuleNotFoundError(
                f"adapters.vllm (VllmRolloutEngine) needs vllm=={PINNED_VLLM} (pip install 'vllm=={PINNED_VLLM}')",
                name="vllm") from err
        return cls(LLM(**engine_kwargs))

    def call(self, step: str, *args: Any) -> Any:
        from adapters.vllm import worker

        fn = getattr(worker, f"rpc_{step}")
        return self.llm.collective_rpc(fn, args=args)[0]


@attrs.define
class VllmRolloutEngine:
    """A RolloutEngine over vLLM workers.

    Attributes:
        workers: where the refit steps run.
        log_prob_fn: serves `log_probs(input_ids, temperature)` (client.LlmLogProbs on a real
            engine); None = this engine does not serve log-probs.
        reset_kv_scales: reset uncalibrated KV-cache scales after each refit.
        expected_layout: checkpoint name -> (shape, dtype) of every tensor a refit sends; when
            given, a bucket with an unknown, mis-shaped, mis-typed or repeated tensor is rejected
            (EngineTensorMismatch) before vLLM sees it (vLLM's loaders would cast or skip it).
        stale_reason: why the engine does not serve (it starts stale: until the first refit its
            weights are whatever it was started with, e.g. a dummy load).
    """

    workers: VllmWorkers
    log_prob_fn: LogProbFn | None = None
    reset_kv_scales: bool = True
    expected_layout: Layout | None = None
    stale_reason: str | None = "no refit has completed yet"
    _seen: set[str] = attrs.field(init=False, factory=set)
    _session: RefitSession = attrs.field(init=False, factory=RefitSession)
    _before: StorageFingerprint | None = attrs.field(init=False, default=None)
    _started: bool = attrs.field(init=False, default=False)

    @classmethod
    def in_process(cls, model: torch.nn.Module, model_config: object, hooks: object, **kwargs: Any) -> VllmRolloutEngine:
        """An engine whose worker is `model` in this process (hooks: VllmHooks)."""
        refit = WorkerRefit(model, model_config, hooks)  # type: ignore[arg-type]
        return cls(LocalWorkers(refit), **kwargs)

    @property
    def commit_mode(self) -> CommitMode:
        return CommitMode.PER_LAYER

    @property
    def is_stale(self) -> bool:
        return self.stale_reason is not None

    # --- lifecycle -------------------------------------------------------------------------

    def begin_refit(self, refit_id: int) -> None:
        self._session.begin(refit_id)
        self._started = False
        self._seen = set()
        try:
            self._before = self.workers.call("fingerprint")
            self.workers.call("begin")
            self._started = True
        except Exception as err:
            self._fail(f"begin: {type(err).__name__}: {err}")
            raise

    def load_bucket(self, bucket: Bucket) -> None:
        self._session.accept(bucket)
        try:
            if self.expected_layout is not None:
                check_bucket(bucket, self.expected_layout, self._seen)
            # views of the bucket's buffer: the worker copies them before this returns
            self.workers.call("load", list(unpack_bucket(bucket)))
        except Exception as err:
            self._fail(f"loading bucket {bucket.index}: {type(err).__name__}: {err}")
            raise

    def finalize_refit(self) -> EngineFinalizeResult:
        self._session.finalize()
        try:
            reset, seconds, loaded = self.workers.call("finalize", self.reset_kv_scales)
            self._started = False
            after = self.workers.call("fingerprint")
            changed = self._before.differences(after) if self._before is not None else []
            if changed:
                raise StorageRebound(
                    f"refit {self._session.refit_id}: {len(changed)} captured tensors changed data pointer, "
                    f"shape, stride or dtype after vLLM's finalize (e.g. {changed[:3]}); the layerwise "
                    "reload must copy into the kept kernel tensors"
                )
        except Exception as err:
            self._fail(f"finalize: {type(err).__name__}: {err}")
            raise
        self._session.commit()
        self.stale_reason = None
        log.info("vllm refit finalized", refit_id=self._session.refit_id, kv_scales_reset=reset, tensors=loaded)
        return EngineFinalizeResult(kv_scales_reset=reset, postprocess_seconds=seconds, tensors_committed=loaded)

    def abort_refit(self, reason: str) -> None:
        if self._session.in_progress:
            self._fail(reason)

    def mark_stale(self, reason: str) -> None:
        if self._session.in_progress:
            self._fail(reason)
        self.stale_reason = reason

    def _fail(self, reason: str) -> None:
        refit_id = self._session.refit_id
        if self._session.in_progress:
            self._session.fail()
        if self._started:
            self._started = False
            try:
                self.workers.call("abort")
            except Exception as err:
                log.warning("vllm abort raised", refit_id=refit_id, error=f"{type(err).__name__}: {err}")
        self.stale_reason = f"refit {refit_id} failed ({reason}); vLLM's layerwise reload cannot roll back"
        log.warning("vllm refit failed; engine is stale", refit_id=refit_id, reason=reason)

    # --- queries and serving ----------------------------------------------------------------

    def storage_fingerprint(self) -> StorageFingerprint:
        return self.workers.call("fingerprint")

    def live_weights(self) -> Mapping[str, torch.Tensor]:
        return MappingProxyType(self.workers.call("live_weights"))

    def log_probs(self, input_ids: torch.Tensor, *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        if self._session.in_progress:
            raise EngineBusy(f"refit {self._session.refit_id} is {self._session.state.value}; not serving")
        if self.stale_reason is not None:
            raise EngineStale(f"engine is stale ({self.stale_reason}); run a full refit before serving")
        if self.log_prob_fn is None:
            raise NotImplementedError("this VllmRolloutEngine was built without log_prob_fn; pass client.LlmLogProbs(llm)")
        return self.log_prob_fn(input_ids, temperature)
