"""The narrow seam between the vLLM adapter and vLLM: the handful of vLLM functions a refit uses.

`VllmHooks.from_vllm()` binds them to the installed vLLM (imported here, lazily); tests bind them
to fakes shaped like vLLM's objects. Every name used below is checked against the pinned vLLM
source by tests/integration/test_engine_conformance.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager

import attrs
import torch

from adapters.vllm.profile import VLLM_RANGE


def _no_context() -> AbstractContextManager[None]:
    return contextlib.nullcontext()


def _no_experts(_model: torch.nn.Module) -> int:
    return 0


def _no_redo(_model: torch.nn.Module, _written: Iterable[str]) -> int:
    return 0


@attrs.frozen
class VllmHooks:
    """vLLM's refit entry points, as plain callables.

    Attributes:
        initialize_reload: `initialize_layerwise_reload(model)`: keep the kernel tensors, restore
            checkpoint-format parameters, defer each layer's processing until it is fully loaded.
        finalize_reload: `finalize_layerwise_reload(model, model_config)`: process the layers
            not processed yet (attention last) and copy every result into the kernel tensors.
        is_kv_cache_method: True for an attention layer's KV-cache quant method
            (`isinstance(quant_method, BaseKVCacheMethod)`).
        set_default_kv_scales: `set_default_quant_scales(layer, register_buffer=False)`: q/k/v/prob
            scales to 1.0, host copies included.
        load_context: a context for `model.load_weights` during a refit
            (`disable_mtp_completeness_check`: a refit bucket is never a complete checkpoint).
        check_experts: before a refit touches anything, refuse (EngineRefitUnsupported) expert
            layers whose post-processing the reload skips and cannot be redone
            (adapters.vllm.experts.check_experts); returns how many will be redone.
        redo_experts: after the reload, redo that post-processing on the layers the refit wrote
            (adapters.vllm.experts.redo_experts); returns how many were redone.
    """

    initialize_reload: Callable[[torch.nn.Module], None]
    finalize_reload: Callable[[torch.nn.Module, object], None]
    is_kv_cache_method: Callable[[object], bool]
    set_default_kv_scales: Callable[[torch.nn.Module], None]
    load_context: Callable[[], AbstractContextManager[None]] = _no_context
    check_experts: Callable[[torch.nn.Module], int] = _no_experts
    redo_experts: Callable[[torch.nn.Module, Iterable[str]], int] = _no_redo

    @classmethod
    def from_vllm(cls) -> VllmHooks:
        """Bind to the installed vLLM.

        Returns:
            The hooks. Raises ModuleNotFoundError naming the adapter when vllm is missing.
        """
        from adapters.vllm import experts

        try:
            from vllm.model_executor.layers.attention.attention import set_default_quant_scales
            from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
            from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
            from vllm.model_executor.model_loader.reload import (
                finalize_layerwise_reload,
                initialize_layerwise_reload,
            )
        except ModuleNotFoundError as err:
            if err.name is None or not err.name.startswith("vllm"):
                raise
            raise ModuleNotFoundError(
                f"adapters.vllm (VllmRolloutEngine) needs vllm {VLLM_RANGE} (pip install 'rl-refit[vllm]')",
                name="vllm",
            ) from err
        return cls(
            initialize_reload=initialize_layerwise_reload,
            finalize_reload=finalize_layerwise_reload,
            is_kv_cache_method=lambda qm: isinstance(qm, BaseKVCacheMethod),
            set_default_kv_scales=lambda layer: set_default_quant_scales(layer, register_buffer=False),
            load_context=disable_mtp_completeness_check,
            check_experts=experts.check_experts,
            redo_experts=experts.redo_experts,
        )
