"""The merged mode: W + scaling * (B @ A), exactly as PEFT's `merge_and_unload()` computes it.

`delta_weight` ports `peft.tuners.lora.layer.Linear.get_delta_weight` expression for expression
(on CPU, half-precision adapters are multiplied in float32 and cast back, as PEFT does), and
`merge_weight` its default (unsafe) `merge`: `base_layer.weight.data += delta_weight`, an in-place
add into the base weight's dtype (a float32 adapter on a BF16 base is added in float32 and rounded
once). The result is bit-identical to the weight `merge_and_unload()` leaves in the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from domain.errors import LoraUnknownTarget
from domain.lora.adapter import LoraAdapter, LoraWeights, check_fits

Tensor = torch.Tensor


def delta_weight(w: LoraWeights, scaling: float) -> Tensor:
    """PEFT's `Linear.get_delta_weight` (fan_in_fan_out False): `(B @ A) * scaling`.

    Args:
        w: the module's lora_A [r, K] and lora_B [N, r].
        scaling: the adapter's scaling (`LoraAdapter.scaling`).

    Returns:
        The [N, K] delta in lora_B's dtype.
    """
    device, dtype = w.lora_B.device, w.lora_B.dtype
    cast_to_fp32 = device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
    weight_a, weight_b = w.lora_A, w.lora_B
    if cast_to_fp32:
        weight_a, weight_b = weight_a.float(), weight_b.float()
    out = (weight_b @ weight_a) * scaling
    if cast_to_fp32:
        out = out.to(dtype=dtype)
    return out


def merge_weight(module: str, weight: Tensor, w: LoraWeights, scaling: float) -> Tensor:
    """The merged weight of one module, as a new tensor (the trainer's `weight` is not touched).

    Args:
        module: the module's name (for errors).
        weight: the base weight [N, K], in the trainer's dtype.
        w: the module's adapter weights.
        scaling: the adapter's scaling.

    Returns:
        `weight + delta` in `weight`'s dtype, computed as PEFT's in-place merge does.

    Raises:
        LoraShapeMismatch: the adapter does not fit the weight.
    """
    check_fits(module, w, tuple(weight.shape))
    merged = weight.detach().clone()
    merged += delta_weight(w, scaling)
    return merged


def merged_stream(weights: Iterable[tuple[str, Tensor]], adapter: LoraAdapter) -> Iterator[tuple[str, Tensor]]:
    """The refit's export stream with the adapter merged: `(name, W) -> (name, W merged)`.

    Weights the adapter does not target pass through unchanged (the same tensor). Lazy: one
    merged weight at a time, so it can feed `quantize_stream` directly.

    Args:
        weights: the base model's (Hugging Face name, tensor) pairs.
        adapter: the adapter to merge.

    Returns:
        An iterator of (name, tensor) pairs in the input's order.

    Raises:
        LoraShapeMismatch: a module's adapter does not fit its weight.
        LoraUnknownTarget: once the stream ends, a module of the adapter never came by.
    """
    seen: set[str] = set()
    for name, tensor in weights:
        module = name.removesuffix(".weight")
        w = adapter.modules.get(module) if name.endswith(".weight") else None
        if w is None:
            yield name, tensor
            continue
        seen.add(module)
        yield name, merge_weight(module, tensor, w, adapter.scaling)
    missing = sorted(set(adapter.modules) - seen)
    if missing:
        raise LoraUnknownTarget(missing[0], f"no weight `{missing[0]}.weight` in the exported model "
                                f"({len(missing)} adapter module(s) unmatched)",
                                "export the model the adapter was trained on, with Hugging Face names")
