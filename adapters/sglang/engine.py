"""SglangRolloutEngine: the RolloutEngine port over an SGLang weight-update session.

Per refit: `begin_weight_update()`, a BEGIN marker carrying the staging rule, one
`update_weights_from_tensor(..., load_format=LOADER_PATH)` per bucket, a FINAL marker (the
loader rebuilds kernel layouts once, in the captured storage), `end_weight_update()`.
On any failure the loader restores the live weights from its backup: commit mode TRANSACTIONAL.

The adapter reaches SGLang through `SglangClient`, four calls wide: `adapters.sglang.client.EngineClient`
wraps a real `sglang.Engine` (imported lazily); tests use a fake shaped like it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

import attrs
import structlog
import torch

from adapters.sglang.profile import check_plan
from adapters.sglang.staging import (
    ABORT_MARKER,
    BEGIN_MARKER,
    FINAL_MARKER,
    LOADER_PATH,
    StagingRule,
    marker,
)
from domain.errors import AdapterUpdateFailed, EngineUpdateFailed
from domain.lora.adapter import LoraAdapter
from domain.lora.sync import StagedAdapter, peft_config
from domain.quant.plan import QuantizationPlan
from domain.quant.rules import check_sync_backend
from domain.refit.buckets import Bucket, unpack_bucket
from domain.refit.engine_layout import Layout, check_bucket
from domain.refit.guard import EngineGuard
from domain.refit.report import EngineFinalizeResult
from domain.refit.session import CommitMode
from domain.refit.storage import StorageFingerprint

log = structlog.get_logger()

NamedTensors = list[tuple[str, torch.Tensor]]
# Called with (input_ids, temperature), and `lora_path=` the served adapter's name when there is one.
LogProbFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class SglangClient(Protocol):
    """The four SGLang calls a refit makes, plus the two queries the checks read."""

    def begin_weight_update(self) -> tuple[bool, str]: ...

    def update_weights_from_tensor(self, named_tensors: NamedTensors, load_format: str,
                                   flush_cache: bool) -> tuple[bool, str]: ...

    def end_weight_update(self) -> tuple[bool, str]: ...

    def storage_fingerprint(self) -> StorageFingerprint: ...

    def live_weights(self) -> Mapping[str, torch.Tensor]: ...


@runtime_checkable
class SglangLoraClient(Protocol):
    """SGLang's LoRA calls (an engine started with `enable_lora`): adapters by name."""

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: dict[str, torch.Tensor],
                                       config_dict: dict[str, Any]) -> tuple[bool, str]: ...

    def unload_lora_adapter(self, lora_name: str) -> tuple[bool, str]: ...

    def flush_cache(self) -> tuple[bool, str]: ...


@attrs.define
class SglangRolloutEngine:
    """A RolloutEngine over SGLang.

    Attributes:
        client: the SGLang seam.
        plan: the rollout plan (validated against SGLang's restrictions and the sync settings).
        native_mxfp8: the dispatch chose SGLang's native MXFP8 layout (`weight_scale_inv`).
        sync_backend: rollout.checkpoint_engine.backend (a quantized rollout rejects delta sync).
        wire_format: rollout.wire_format (a quantized rollout rejects `delta_flush`).
        log_prob_fn: serves log-probs; None = not served by this adapter.
        expected_layout: checkpoint name -> (shape, dtype) of every tensor a refit sends; when
            given, a bucket with an unknown, mis-shaped, mis-typed or repeated tensor is rejected
            (EngineTensorMismatch) before SGLang sees it.
    """

    client: SglangClient
    plan: QuantizationPlan = attrs.field(factory=QuantizationPlan.bf16)
    native_mxfp8: bool = False
    sync_backend: str | None = None
    wire_format: str | None = None
    log_prob_fn: LogProbFn | None = None
    expected_layout: Layout | None = None
    # The loader backs up what a refit overwrites and restores it on any failure.
    commit_mode: CommitMode = attrs.field(init=False, default=CommitMode.TRANSACTIONAL)
    _guard: EngineGuard = attrs.field(init=False)
    _seen: set[str] = attrs.field(init=False, factory=set)
    _rule: StagingRule = attrs.field(init=False)
    _open: bool = attrs.field(init=False, default=False)
    _tensors: int = attrs.field(init=False, default=0)
    _staged_bytes: int = attrs.field(init=False, default=0)
    _lora: int | None = attrs.field(init=False, default=None)  # the adapter requests are served with
    _next_lora: int = attrs.field(init=False, default=1)

    def __attrs_post_init__(self) -> None:
        self._guard = EngineGuard(on_fail=self._fail)
        check_plan(self.plan)
        check_sync_backend(self.plan.is_quantized, backend=self.sync_backend, wire_format=self.wire_format)
        self._rule = StagingRule.for_plan(self.plan, native_mxfp8=self.native_mxfp8)

    @property
    def is_stale(self) -> bool:
        return self._guard.is_stale

    # --- lifecycle -------------------------------------------------------------------------

    def _update(self, named: NamedTensors, *, flush_cache: bool = False) -> None:
        ok, message = self.client.update_weights_from_tensor(named, LOADER_PATH, flush_cache)
        if not ok:
            raise EngineUpdateFailed(f"SGLang update_weights_from_tensor failed: {message}")

    def begin_refit(self, refit_id: int) -> None:
        self._guard.begin(refit_id)
        self._tensors = self._staged_bytes = 0
        self._seen = set()
        try:
            ok, message = self.client.begin_weight_update()
            if not ok:
                raise EngineUpdateFailed(f"SGLang begin_weight_update failed: {message}")
            self._open = True
            self._update([(BEGIN_MARKER, self._rule.to_tensor(refit_id))])
        except Exception as err:
            self._fail(f"begin: {type(err).__name__}: {err}")
            raise

    def load_bucket(self, bucket: Bucket) -> None:
        self._guard.accept(bucket)
        named = list(unpack_bucket(bucket))
        try:
            if self.expected_layout is not None:
                check_bucket(bucket, self.expected_layout, self._seen)
            self._update(named)  # returns once SGLang's loader has copied or loaded them
        except Exception as err:
            self._fail(f"loading bucket {bucket.index}: {type(err).__name__}: {err}")
            raise
        self._tensors += len(named)
        self._staged_bytes += sum(t.nbytes for n, t in named if self._rule.must_stage(n))

    def finalize_refit(self) -> EngineFinalizeResult:
        self._guard.finalize()
        t0 = time.perf_counter()
        try:
            self._update([marker(FINAL_MARKER)], flush_cache=True)
            self._close_session()
        except Exception as err:
            self._fail(f"finalize: {type(err).__name__}: {err}")
            raise
        seconds = time.perf_counter() - t0
        self._guard.commit()
        return EngineFinalizeResult(postprocess_seconds=seconds, tensors_committed=self._tensors,
                                    peak_staging_bytes=self._staged_bytes)

    def _close_session(self) -> None:
        if self._open:
            self._open = False
            ok, message = self.client.end_weight_update()
            if not ok:
                raise EngineUpdateFailed(f"SGLang end_weight_update failed: {message}")

    def abort_refit(self, reason: str) -> None:
        self._guard.abort(reason)

    def mark_stale(self, reason: str) -> None:
        self._guard.mark_stale(reason)

    def _fail(self, reason: str) -> None:
        refit_id = self._guard.refit_id
        stale = False
        try:
            if self._open:
                self._update([marker(ABORT_MARKER)])  # restores unless the loader already did
                self._close_session()
        except Exception as err:  # could not confirm the restore: never serve a half update
            stale = True
            reason = f"{reason}; restore failed: {type(err).__name__}: {err}"
        self._guard.fail(stale_reason=f"refit {refit_id} failed ({reason})" if stale else None)
        log.warning("sglang refit failed", refit_id=refit_id, reason=reason, stale=stale)

    # --- queries and serving ----------------------------------------------------------------

    def storage_fingerprint(self) -> StorageFingerprint:
        return self.client.storage_fingerprint()

    def live_weights(self) -> Mapping[str, torch.Tensor]:
        return MappingProxyType(dict(self.client.live_weights()))

    def log_probs(self, input_ids: torch.Tensor, *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs, with the served LoRA adapter when there is one (`lora_path=` its name)."""
        self._guard.check_serving()
        if self.log_prob_fn is None:
            raise NotImplementedError("this SglangRolloutEngine was built without log_prob_fn")
        if self._lora is None:
            return self.log_prob_fn(input_ids, temperature)
        return self.log_prob_fn(input_ids, temperature, lora_path=self.serving_lora_name)

    # --- the adapter mode (ports.lora_engine) -----------------------------------------------------

    @property
    def serving_adapter(self) -> int | None:
        return self._lora

    @property
    def serving_lora_name(self) -> str | None:
        """The name a request gives SGLang (`lora_path`) to be served with the current adapter."""
        return None if self._lora is None else lora_name(self._lora)

    def _lora_client(self) -> SglangLoraClient:
        if not isinstance(self.client, SglangLoraClient):
            raise AdapterUpdateFailed(f"{type(self.client).__name__} has no LoRA calls: start SGLang with "
                                      "enable_lora", self._lora)
        return self.client

    def stage_adapter(self, adapter: LoraAdapter) -> StagedAdapter:
        """SGLang builds `adapter` under a fresh name (`load_lora_adapter_from_tensors`, from copies
        it owns) while the current one serves (LoraEngine port)."""
        client = self._lora_client()
        adapter_id, self._next_lora = self._next_lora, self._next_lora + 1
        tensors = {name: t.detach().clone() for name, t in adapter.named_tensors()}
        try:
            ok, message = client.load_lora_adapter_from_tensors(lora_name(adapter_id), tensors, peft_config(adapter))
            if not ok:
                raise EngineUpdateFailed(f"SGLang load_lora_adapter_from_tensors failed: {message}")
        except Exception as err:
            self._unload(adapter_id)
            raise AdapterUpdateFailed(f"staging adapter {adapter_id}: {type(err).__name__}: {err}", self._lora) from err
        return StagedAdapter(adapter_id, sum(t.numel() * t.element_size() for t in tensors.values()))

    def commit_adapter(self, staged: StagedAdapter) -> None:
        """Serve the staged adapter's name from the next request on, flush the radix cache (its
        entries of the previous adapter), then unload the previous one."""
        client = self._lora_client()
        previous, self._lora = self._lora, staged.adapter_id
        ok, message = client.flush_cache()
        if not ok:
            log.warning("SGLang flush_cache failed", adapter_id=staged.adapter_id, message=message)
        if previous is not None:
            self._unload(previous)

    def abort_adapter(self, staged: StagedAdapter) -> None:
        if staged.adapter_id != self._lora:
            self._unload(staged.adapter_id)

    def _unload(self, adapter_id: int) -> None:
        try:
            ok, message = self._lora_client().unload_lora_adapter(lora_name(adapter_id))
        except Exception as err:
            ok, message = False, f"{type(err).__name__}: {err}"
        if not ok:
            log.warning("SGLang unload_lora_adapter failed", adapter_id=adapter_id, message=message)


def lora_name(adapter_id: int) -> str:
    """The name SGLang holds rl-refit's adapter `adapter_id` under (one name per version)."""
    return f"rl-refit-{adapter_id}"
