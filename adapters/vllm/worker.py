"""The worker side of a vLLM refit: what runs next to the model, inside each vLLM worker.

`WorkerRefit` drives vLLM's layerwise reload on one model: initialize before the first bucket,
`model.load_weights` per bucket with checkpoint-format names (each tensor cloned first: vLLM
buffers a layer's tensors *by reference* until the layer is complete, and the sender reuses its
bucket buffer as soon as a bucket is acknowledged), finalize once after the last bucket, then the
KV-cache scale reset. The `rpc_*` functions are what `LLM.collective_rpc` runs in each worker.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import NamedTuple

import attrs
import structlog
import torch

from adapters.vllm.hooks import VllmHooks
from domain.errors import RefitLifecycleError
from domain.refit.storage import StorageFingerprint

log = structlog.get_logger()

KV_SCALE_NAMES = ("q_scale", "k_scale", "v_scale", "prob_scale")


class FinalizeStats(NamedTuple):
    """What one worker's finalize did (a tuple: it crosses process boundaries as one)."""

    kv_scales_reset: int
    seconds: float
    tensors_loaded: int


@attrs.define
class WorkerRefit:
    """One worker's refit of one model through vLLM's layerwise reload.

    Attributes:
        model: the served model (vLLM's `nn.Module`, or a fake shaped like it).
        model_config: vLLM's ModelConfig (finalize needs its dtype for attention layers).
        hooks: vLLM's functions (or fakes).
        device: where clones of received tensors go (default: the model's first parameter's device).
        reset_kv_scales: reset uncalibrated KV-cache scales after finalize.
    """

    model: torch.nn.Module
    model_config: object
    hooks: VllmHooks
    device: torch.device | None = None
    reset_kv_scales: bool = True
    loading: bool = attrs.field(init=False, default=False)
    tensors_loaded: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        if self.device is None:
            first = next(iter(self.model.parameters()), None)
            self.device = first.device if first is not None else torch.device("cpu")

    def begin(self) -> None:
        """Initialize the layerwise reload (kernel tensors kept, loaders deferred)."""
        if self.loading:
            raise RefitLifecycleError("a vLLM refit is already loading on this worker; finalize or abort it first")
        self.hooks.initialize_reload(self.model)
        self.loading = True
        self.tensors_loaded = 0

    def load(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket's tensors by checkpoint name; returns how many were loaded.

        Every tensor is copied first, so that nothing vLLM buffers aliases the sender's buffer.
        """
        if not self.loading:
            raise RefitLifecycleError("load before begin: call begin() first")
        owned = [(name, t.to(self.device, copy=True)) for name, t in named_tensors]
        load_weights = self.model.load_weights  # every vLLM model class defines it
        with self.hooks.load_context():
            load_weights(owned)  # type: ignore[operator]
        self.tensors_loaded += len(owned)
        return len(owned)

    def finalize(self) -> FinalizeStats:
        """Finalize the reload once, then reset KV-cache scales.

        Returns:
            The attention layers whose scales were reset, the seconds of post-processing and the
            tensors loaded.
        """
        if not self.loading:
            raise RefitLifecycleError("finalize without a loading refit: call begin() first")
        t0 = time.perf_counter()
        try:
            self.hooks.finalize_reload(self.model, self.model_config)
        finally:
            self.loading = False
        seconds = time.perf_counter() - t0
        reset = self.reset_uncalibrated_kv_scales() if self.reset_kv_scales else 0
        return FinalizeStats(reset, seconds, self.tensors_loaded)

    def abort(self) -> None:
        """Put the model back together after a failure (no-op when not loading).

        vLLM cannot roll back: layers processed before the failure hold the new weights. The
        finalize puts the kept kernel tensors back, so the model is whole (but mixed) again.
        """
        if not self.loading:
            return
        self.loading = False
        try:
            self.hooks.finalize_reload(self.model, self.model_config)
        except Exception as err:  # the engine is marked stale either way
            log.warning("vllm finalize after a failed refit raised", error=f"{type(err).__name__}: {err}")

    def reset_uncalibrated_kv_scales(self) -> int:
        """q/k/v/prob scales to 1.0 on attention layers with a KV-cache quant method whose config
        has no `kv_cache_scheme` (their scales are loader placeholders, or left from a dummy load).

        Returns:
            The number of attention layers reset.
        """
        count = 0
        with torch.no_grad():  # scales may be grad-requiring Parameters: fill them in place
            for name, layer in self.model.named_modules():
                qm = getattr(layer, "quant_method", None)
                if qm is None or not self.hooks.is_kv_cache_method(qm):
                    continue
                if getattr(getattr(qm, "quant_config", None), "kv_cache_scheme", None) is not None:
                    continue  # calibrated scales from the checkpoint: keep them
                self.hooks.set_default_kv_scales(layer)
                for scale in KV_SCALE_NAMES:
                    t = getattr(layer, scale, None)
                    if isinstance(t, torch.Tensor):
                        t.fill_(1.0)
                log.debug("kv-cache scales reset to 1.0", layer=name)
                count += 1
        return count

    def fingerprint(self) -> StorageFingerprint:
        """Pointer, shape, stride and dtype of every parameter and buffer (what graphs capture)."""
        return StorageFingerprint.of(self.live_weights())

    def live_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer of the model, by its module path."""
        tensors: dict[str, torch.Tensor] = dict(self.model.named_parameters())
        tensors.update(self.model.named_buffers())
        return tensors


# --- what LLM.collective_rpc runs inside each worker (`worker` is vLLM's Worker) ---------------


def _refit(worker: object) -> WorkerRefit:
    refit = getattr(worker, "rl_refit", None)
    if refit is None:
        refit = WorkerRefit(
            model=worker.get_model(),  # type: ignore[attr-defined]
            model_config=worker.vllm_config.model_config,  # type: ignore[attr-defined]
            hooks=VllmHooks.from_vllm(),
        )
        worker.rl_refit = refit  # type: ignore[attr-defined]
    return refit


def _in_config(worker: object) -> AbstractContextManager[object]:
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(worker.vllm_config)  # type: ignore[attr-defined]


def rpc_begin(worker: object) -> None:
    with _in_config(worker):
        _refit(worker).begin()


def rpc_load(worker: object, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
    with _in_config(worker):
        return _refit(worker).load(named_tensors)


def rpc_finalize(worker: object, reset_kv_scales: bool) -> FinalizeStats:
    with _in_config(worker):
        refit = _refit(worker)
        refit.reset_kv_scales = reset_kv_scales
        return refit.finalize()


def rpc_abort(worker: object) -> None:
    with _in_config(worker):
        _refit(worker).abort()


def rpc_fingerprint(worker: object) -> StorageFingerprint:
    return _refit(worker).fingerprint()


def rpc_live_weights(worker: object) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu() for n, t in _refit(worker).live_weights().items()}
