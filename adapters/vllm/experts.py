"""Unquantized MoE layers whose expert post-processing vLLM's layerwise reload skips, and the redo.

vLLM 0.32-0.33 `UnquantizedFusedMoEMethod._setup_kernel`
(`vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py:166-205`) runs the
experts' own `process_weights_after_loading` only on the first load (`if not is_weight_update`).
On CPU that hook is the prepack into the grouped-GEMM tile layout (`CPUUnquantizedExperts`,
`experts/cpu_moe.py:208-218`). A refit through the layerwise reload therefore copies plain
`[E, 2I, H]` / `[E, H, I]` bytes into storage the kernel reads as tiles: the shapes match, the
storage check passes, and the engine serves other weights.

`check_experts` runs before a refit touches anything: it refuses, with EngineRefitUnsupported,
layers that cannot be redone (a padded intermediate size, whose reload raises halfway; an expert
class whose skipped hook this module does not know). `redo_experts` runs after the reload, on
the layers the refit wrote: it prepacks the new plain bytes into the kept storage, from a copy
(the prepack is neither in place nor idempotent), so data pointers survive.

vllm is imported only inside these functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from adapters.vllm.errors import EngineRefitUnsupported

_EXPERT_WEIGHTS = ("w13_weight", "w2_weight")


def _skipped_hooks(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, object]]:
    """(module name, module, fused experts) for every unquantized MoE layer whose experts define
    a post-processing hook of their own (the one a reload skips)."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    base_hook = FusedMoEExperts.process_weights_after_loading
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, UnquantizedFusedMoEMethod):
            continue
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if experts is None or type(experts).process_weights_after_loading is base_hook:
            continue
        yield name, module, experts


def check_experts(model: torch.nn.Module) -> int:
    """Refuse a refit that would leave unquantized experts in the wrong layout.

    Args:
        model: the served model.

    Returns:
        The number of layers `redo_experts` will redo.

    Raises:
        EngineRefitUnsupported: naming the first layer that cannot be redone and why.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    count = 0
    for name, _module, experts in _skipped_hooks(model):
        kind = type(experts).__name__
        if not isinstance(experts, CPUUnquantizedExperts):
            raise EngineRefitUnsupported(
                f"{name}: vLLM's reload skips the post-processing of {kind} experts "
                "(UnquantizedFusedMoEMethod._setup_kernel runs it on the first load only), so a refit "
                "would serve unprocessed expert weights; quantize the experts (rollout.quantization.moe) "
                "or restart the engine from the exported checkpoint"
            )
        if getattr(experts, "_use_zentorch", False):
            continue  # the zentorch path keeps plain weights: the reload's copy is right as it is
        config = experts.moe_config
        padded = experts._padded_intermediate_size(config)
        if padded != config.intermediate_size_per_partition:
            raise EngineRefitUnsupported(
                f"{name}: vLLM's CPU experts padded the intermediate size "
                f"{config.intermediate_size_per_partition} to {padded}, and its layerwise reload "
                "cannot copy the unpadded weights into them (it raises halfway through a refit); use "
                "a moe_intermediate_size that is a multiple of 32 per partition, or quantize the experts"
            )
        count += 1
    return count


@torch.no_grad()
def redo_experts(model: torch.nn.Module, written: Iterable[str]) -> int:
    """Prepack the expert weights a refit wrote, into the storage the kernel reads.

    Args:
        model: the served model, after `finalize_layerwise_reload`.
        written: the parameter names the refit's loads reported (layers it did not write keep
            their prepacked bytes and are left alone).

    Returns:
        The number of layers redone.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    done = set(written)
    count = 0
    for name, module, experts in _skipped_hooks(model):
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        prefix = f"{name}." if name else ""
        if not all(prefix + w in done for w in _EXPERT_WEIGHTS):
            continue
        for w in _EXPERT_WEIGHTS:
            param = getattr(module, w)
            plain = param.detach().clone()  # the prepack reads a separate source
            torch.ops._C.prepack_moe_weight(plain, param.data, experts.isa)
        count += 1
    return count
