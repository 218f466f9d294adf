"""VllmRolloutEngine: the RolloutEngine port over vLLM's layerwise reload.

The adapter talks to the workers through `VllmWorkers`, one typed method per refit step:
- `LocalWorkers` runs a WorkerRefit in this process (fakes, tests);
- `adapters.vllm.client.ExtensionWorkers` runs it inside the workers of an in-process `vllm.LLM`
  started with rl-refit's worker extension (colocated: buckets by reference);
- `adapters.vllm.attached.AttachedWorkers` drives a vLLM server (the user's, or one rl-refit
  started: adapters.vllm.launcher) through vLLM's own control plane, and streams the buckets to
  its workers over rl-refit's transport (the shared-memory ring on one host, a side group).

Commit mode PER_LAYER: vLLM processes and commits each layer as soon as its tensors are in and
keeps no copy of the old weights. In-process workers cannot roll a failure back: the engine is
marked stale and refuses to serve until a full refit succeeds. A server's workers keep the last
live refit's buckets and put them back (`restores`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, Protocol

import attrs
import structlog
import torch

from adapters.vllm.errors import EngineRefitUnsupported
from adapters.vllm.hooks import VllmHooks
from adapters.vllm.lora import LoraServing
from adapters.vllm.protocol import FinalizeReply
from adapters.vllm.worker import WorkerRefit
from domain.errors import AdapterUpdateFailed
from domain.lora.adapter import LoraAdapter
from domain.lora.sync import StagedAdapter, peft_config
from domain.refit.buckets import Bucket, unpack_bucket
from domain.refit.delta_sync import DeltaBase
from domain.refit.engine_layout import Layout, check_bucket
from domain.refit.guard import EngineGuard
from domain.refit.report import EngineFinalizeResult
from domain.refit.session import CommitMode
from domain.refit.storage import StorageFingerprint

log = structlog.get_logger()

# Called with (input_ids, temperature) or (prompts, max_tokens), and `lora=` when an adapter serves.
LogProbFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
GreedyFn = Callable[..., list[list[int]]]


@attrs.frozen
class Aborted:
    """What an abort did on workers that keep a backup: whether the previous weights are back,
    and if not, why (the workers' own words)."""

    restored: bool
    why: str = ""


class VllmWorkers(Protocol):
    """The refit steps on every vLLM worker; each returns the first worker's result."""

    def begin(self) -> None:
        """Start vLLM's layerwise reload."""
        ...

    def load(self, bucket: Bucket) -> int:
        """Load one bucket's tensors by checkpoint name; the bucket's buffer may be reused as soon
        as this returns unless the bucket is retained (then the workers may keep views of it)."""
        ...

    def finalize(self, reset_kv_scales: bool) -> FinalizeReply:
        """Finalize the reload once, then reset uncalibrated KV-cache scales."""
        ...

    def abort(self) -> Aborted | None:
        """Put the model back together after a failure; workers that keep a backup say whether
        the previous weights are back (Aborted), the others nothing (None)."""
        ...

    def fingerprint(self) -> StorageFingerprint:
        """Pointer, shape, stride and dtype of every parameter and buffer."""
        ...

    def delta_base(self) -> DeltaBase:
        """The workers' delta receivers (the first call turns them on)."""
        ...

    def live_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer, by module path (host copies out of process)."""
        ...

    def digests(self) -> dict[str, str]:
        """sha256 of every parameter and buffer, by module path."""
        ...

    def kv_scales(self) -> dict[str, list[float]]:
        """Each attention layer's q/k/v/prob scales, by module name."""
        ...

    def lora_stage(self, adapter_id: int, config: Mapping[str, Any], tensors: bytes) -> int:
        """Every worker builds a LoRA adapter under `adapter_id`; returns the bytes sent to them."""
        ...

    def lora_drop(self, adapter_id: int) -> None:
        """Every worker drops `adapter_id`."""
        ...

    def reset_prefix_cache(self) -> None:
        """Drop every prefix-cache entry of the engine."""
        ...

    def close(self) -> None:
        """Shut the workers down (their engine with them)."""
        ...


@attrs.define
class LocalWorkers:
    """The refit steps on a WorkerRefit in this process."""

    refit: WorkerRefit

    def begin(self) -> None:
        self.refit.begin()

    def load(self, bucket: Bucket) -> int:
        return self.refit.load(list(unpack_bucket(bucket)), bucket.retained)

    def finalize(self, reset_kv_scales: bool) -> FinalizeReply:
        self.refit.reset_kv_scales = reset_kv_scales
        return FinalizeReply(**self.refit.finalize()._asdict())

    def abort(self) -> None:
        self.refit.abort()

    def fingerprint(self) -> StorageFingerprint:
        return self.refit.fingerprint()

    def delta_base(self) -> DeltaBase:
        return self.refit.delta_base()

    def live_weights(self) -> dict[str, torch.Tensor]:
        return self.refit.live_weights()

    def digests(self) -> dict[str, str]:
        from adapters.vllm.extension import weight_digests

        return weight_digests(self.refit)

    def kv_scales(self) -> dict[str, list[float]]:
        from adapters.vllm.extension import kv_scales

        return kv_scales(self.refit.model)

    def lora_stage(self, adapter_id: int, config: Mapping[str, Any], tensors: bytes) -> int:
        raise AdapterUpdateFailed("an engine over a bare model in this process serves no LoRA adapters", None)

    def lora_drop(self, adapter_id: int) -> None:
        return None  # it never holds one

    def reset_prefix_cache(self) -> None:
        return None  # no cache

    def close(self) -> None:
        return None  # the model belongs to the caller


@attrs.define
class VllmRolloutEngine:
    """A RolloutEngine over vLLM workers.

    Attributes:
        workers: where the refit steps run.
        log_prob_fn: serves `log_probs(input_ids, temperature)` (client.LlmLogProbs on a real
            engine); None = this engine does not serve log-probs.
        greedy_fn: serves `greedy(prompts, max_tokens)`; None = not served.
        reset_kv_scales: reset uncalibrated KV-cache scales after each refit.
        expected_layout: checkpoint name -> (shape, dtype) of every tensor a refit sends; when
            given, a bucket with an unknown, mis-shaped, mis-typed or repeated tensor is rejected
            (EngineTensorMismatch) before vLLM sees it (vLLM's loaders would cast or skip it).
        owned_dirs: directories made for this engine (the embedded model's config.json), removed
            by `close`.
        restores: the workers keep a backup and put the previous weights back when a refit fails
            (an attached server's rl_refit backend: adapters.vllm.session); their `abort` and
            `restore` say whether the weights are back (Aborted). False: a failed refit leaves the
            engine stale.
        serves_from_start: the engine serves the weights it started with (an attached server
            started from a checkpoint); False: it refuses to serve until its first refit.

    The engine starts stale (unless `serves_from_start`): until the first refit its weights are
    whatever it was started with (e.g. a dummy load).
    """

    workers: VllmWorkers
    log_prob_fn: LogProbFn | None = None
    greedy_fn: GreedyFn | None = None
    reset_kv_scales: bool = True
    expected_layout: Layout | None = None
    owned_dirs: tuple[str, ...] = ()
    restores: bool = False
    serves_from_start: bool = False
    # vLLM processes and commits each layer as soon as it is loaded, keeping no old copy.
    commit_mode: CommitMode = attrs.field(init=False, default=CommitMode.PER_LAYER)
    _guard: EngineGuard = attrs.field(init=False)
    _seen: set[str] = attrs.field(init=False, factory=set)
    _started: bool = attrs.field(init=False, default=False)
    _lora: LoraServing | None = attrs.field(init=False, default=None)  # the adapter requests are served with
    _next_lora: int = attrs.field(init=False, default=1)

    @classmethod
    def in_process(cls, model: torch.nn.Module, model_config: object, hooks: VllmHooks, **kwargs: Any) -> VllmRolloutEngine:
        """An engine whose worker is `model` in this process."""
        return cls(LocalWorkers(WorkerRefit(model, model_config, hooks)), **kwargs)

    def __attrs_post_init__(self) -> None:
        self._guard = EngineGuard(on_fail=self._fail)
        if self.serves_from_start:  # a server the user started from a checkpoint serves it
            self._guard.stale_reason = None

    @property
    def is_stale(self) -> bool:
        return self._guard.is_stale

    # --- lifecycle -------------------------------------------------------------------------

    def begin_refit(self, refit_id: int) -> None:
        self._guard.begin(refit_id)
        self._started = False
        self._seen = set()
        try:
            self.workers.begin()
            self._started = True
        except EngineRefitUnsupported:
            self._guard.fail()  # refused before anything was written: the live weights are as they were
            raise
        except Exception as err:
            self._fail(f"begin: {type(err).__name__}: {err}")
            raise

    def load_bucket(self, bucket: Bucket) -> None:
        self._guard.accept(bucket)
        try:
            if self.expected_layout is not None:
                check_bucket(bucket, self.expected_layout, self._seen)
            self.workers.load(bucket)
        except Exception as err:
            self._fail(f"loading bucket {bucket.index}: {type(err).__name__}: {err}")
            raise

    def finalize_refit(self) -> EngineFinalizeResult:
        self._guard.finalize()
        try:
            stats = self.workers.finalize(self.reset_kv_scales)
            self._started = False
        except Exception as err:
            self._fail(f"finalize: {type(err).__name__}: {err}")
            raise
        try:  # the prefix cache holds KV computed with the previous weights: a prompt sharing a cached prefix reuses it
            self.workers.reset_prefix_cache()
        except Exception as err:  # the weights are live either way; say so and go on
            log.warning("prefix cache reset after a refit failed", refit_id=self._guard.refit_id,
                        error=f"{type(err).__name__}: {err}")
        self._guard.commit()
        log.info("vllm refit finalized", refit_id=self._guard.refit_id, kv_scales_reset=stats.kv_scales_reset,
                 tensors=stats.tensors_loaded, parameters_written=stats.parameters_written,
                 unwritten=len(stats.unwritten), experts_redone=stats.experts_redone)
        return EngineFinalizeResult(
            kv_scales_reset=stats.kv_scales_reset, postprocess_seconds=stats.seconds,
            tensors_committed=stats.tensors_loaded,
            parameters_written=stats.parameters_written if stats.parameters_written >= 0 else None,
            unwritten=stats.unwritten,
        )

    def abort_refit(self, reason: str) -> None:
        self._guard.abort(reason)

    def mark_stale(self, reason: str) -> None:
        self._guard.mark_stale(reason)

    def _fail(self, reason: str) -> None:
        """A failed refit: put the model back together (it holds some new layers) and go stale,
        unless the workers put the previous weights back (`restores`)."""
        if self._started:
            self._started = False
            try:
                aborted = self.workers.abort()
            except Exception as err:
                aborted = Aborted(False, f"the restore raised {type(err).__name__}: {err}")
                log.warning("vllm abort raised", refit_id=self._guard.refit_id, error=f"{type(err).__name__}: {err}")
            if self.restores and isinstance(aborted, Aborted):
                if aborted.restored:
                    self._guard.fail()
                    log.warning("vllm refit failed; the previous weights were restored",
                                refit_id=self._guard.refit_id, reason=reason)
                    return
                why = f"refit {self._guard.refit_id} failed ({reason}); {aborted.why}"
                self._guard.fail(stale_reason=why)
                log.warning("vllm refit failed; engine is stale", refit_id=self._guard.refit_id, reason=why)
                return
        why = f"refit {self._guard.refit_id} failed ({reason}); vLLM's layerwise reload cannot roll back"
        self._guard.fail(stale_reason=why)
        log.warning("vllm refit failed; engine is stale", refit_id=self._guard.refit_id, reason=reason)

    def undo_commit(self, reason: str) -> bool:
        """After a committed refit was refused (the probe, the audit): put the previous weights
        back from the workers' backup (ports.rollout_engine.UndoableEngine). True when they are
        back; False when this engine keeps none, or it failed (the engine is then stale)."""
        if not self.restores:
            return False
        try:
            restored = self.workers.restore(reason).restored  # type: ignore[attr-defined]
        except Exception as err:
            log.warning("vllm restore raised", refit_id=self._guard.refit_id, error=f"{type(err).__name__}: {err}")
            restored = False
        if not restored:
            self._guard.mark_stale(f"{reason}; the workers could not restore the previous weights")
        return restored

    def close(self) -> None:
        """Shut the engine down (its workers; an attached server is only let go of) and remove what
        was made for it. A refit in progress is aborted first; afterwards every refit and request
        raises EngineClosed. Idempotent."""
        if self._guard.closed:
            return
        try:
            self._guard.close()
            self.workers.close()
        finally:
            remove_dirs(self.owned_dirs)

    # --- queries and serving ----------------------------------------------------------------

    def storage_fingerprint(self) -> StorageFingerprint:
        self._guard.check_open()
        return self.workers.fingerprint()

    def delta_base(self) -> DeltaBase:
        """The workers' delta receivers (DeltaEngine port): the copy's digest when every worker
        holds the same one, else None; the first call turns them on."""
        return self.workers.delta_base()

    def live_weights(self) -> Mapping[str, torch.Tensor]:
        return MappingProxyType(self.workers.live_weights())

    def log_probs(self, input_ids: torch.Tensor, *, temperature: float = 1.0,
                  lora: LoraServing | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt log-probs, with the served LoRA adapter (or `lora`: another one the engine
        loads itself, e.g. vLLM's own LoRARequest of a directory)."""
        self._guard.check_serving()
        if self.log_prob_fn is None:
            raise NotImplementedError("this VllmRolloutEngine was built without log_prob_fn; pass client.LlmLogProbs(llm)")
        return self.log_prob_fn(input_ids, temperature, **self._with(lora))

    def greedy(self, prompts: list[list[int]], max_tokens: int, *, lora: LoraServing | None = None) -> list[list[int]]:
        """Greedy continuations of token-id prompts (refused while stale or mid-refit), with the
        served LoRA adapter (or `lora`)."""
        self._guard.check_serving()
        if self.greedy_fn is None:
            raise NotImplementedError("this VllmRolloutEngine was built without greedy_fn")
        return self.greedy_fn(prompts, max_tokens, **self._with(lora))

    def _with(self, lora: LoraServing | None) -> dict[str, LoraServing]:
        chosen = lora or self._lora
        return {} if chosen is None else {"lora": chosen}

    # --- the adapter mode (ports.lora_engine) -----------------------------------------------------

    @property
    def serving_adapter(self) -> int | None:
        return None if self._lora is None else self._lora.adapter_id

    def stage_adapter(self, adapter: LoraAdapter) -> StagedAdapter:
        """Every worker builds `adapter` under a fresh id from its serialized tensors (LoraEngine
        port); nothing serves it until `commit_adapter`. A worker that fails: the id is dropped on
        every worker and AdapterUpdateFailed raised, the served adapter untouched."""
        from safetensors.torch import save

        adapter_id, self._next_lora = self._next_lora, self._next_lora + 1
        blob = save({name: t.contiguous() for name, t in adapter.named_tensors()})
        try:
            sent = self.workers.lora_stage(adapter_id, peft_config(adapter), blob)
        except Exception as err:
            self._drop(adapter_id)
            raise AdapterUpdateFailed(f"staging adapter {adapter_id}: {type(err).__name__}: {err}",
                                      self.serving_adapter) from err
        return StagedAdapter(adapter_id, sent)

    def commit_adapter(self, staged: StagedAdapter) -> None:
        """Serve the staged adapter from the next request on, drop the prefix cache (its entries of
        the previous adapter), then the previous id on every worker."""
        previous, self._lora = self._lora, LoraServing.staged(staged.adapter_id)
        try:
            self.workers.reset_prefix_cache()
        except Exception as err:  # entries of the previous adapter stay unreachable (its path is unique)
            log.warning("prefix cache reset failed", adapter_id=staged.adapter_id, error=f"{type(err).__name__}: {err}")
        if previous is not None:
            self._drop(previous.adapter_id)

    def abort_adapter(self, staged: StagedAdapter) -> None:
        """Drop a staged id on every worker (the served one is kept)."""
        if staged.adapter_id != self.serving_adapter:
            self._drop(staged.adapter_id)

    def disk_twin(self, adapter: LoraAdapter, directory: str, adapter_id: int) -> LoraServing:
        """Write `adapter` into `directory` as PEFT writes it (adapter_model.safetensors,
        adapter_config.json) and return the request that names it (ports.engine_inspection
        AdapterTwins): vLLM loads it from there itself, with its own loader, on the first request
        that names it. `adapter_id` must be one rl-refit's staging never uses (it counts from 1)."""
        from pathlib import Path

        from safetensors.torch import save_file

        path = Path(directory)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        save_file({name: t.contiguous() for name, t in adapter.named_tensors()}, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(peft_config(adapter)))
        return LoraServing(f"twin-{adapter_id}", adapter_id, str(path))

    def drop_twin(self, twin: LoraServing) -> None:
        """Release the adapter slot a disk twin holds (its directory is the caller's)."""
        self._drop(twin.adapter_id)

    def _drop(self, adapter_id: int) -> None:
        try:
            self.workers.lora_drop(adapter_id)
        except Exception as err:  # it holds a slot until the engine restarts; nothing serves it
            log.warning("dropping a LoRA adapter failed", adapter_id=adapter_id, error=f"{type(err).__name__}: {err}")

    def digests(self) -> dict[str, str]:
        """sha256 of every parameter and buffer of the (first) worker, to compare engines bit for bit."""
        self._guard.check_open()
        return self.workers.digests()

    def kv_scales(self) -> dict[str, list[float]]:
        """Each attention layer's q/k/v/prob scales on the (first) worker."""
        self._guard.check_open()
        return self.workers.kv_scales()


def remove_dirs(directories: Iterable[str]) -> None:
    """Remove directories made for an engine (the embedded model's config.json), whatever they hold."""
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)
