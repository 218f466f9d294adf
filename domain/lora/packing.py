"""Fused modules as inference engines pack them: q/k/v -> `qkv_proj`, gate/up -> `gate_up_proj`.

An engine that fuses q/k/v into one linear keeps one adapter per slice of it: `lora_A` stacked
per slice (each [r, K]) and `lora_B` per slice ([N_i, r]), with a slice left empty where the
adapter does not target that projection (vLLM's `PackedLoRALayerWeights`). Unfused modules are
one slice. Packing never scales: alpha/r is applied once, by whoever consumes the pack
(`PackedLora.scaled_lora_B` returns new tensors; nothing is scaled in place, so a rebuilt
adapter is never scaled twice).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from domain.lora.adapter import LoraAdapter

Tensor = torch.Tensor

# packed module -> its slices, in the engine's order (the fused weight's row order)
PACKED_MODULES: Mapping[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


@attrs.frozen(eq=False)  # tensors: identity, not elementwise, equality
class PackedLora:
    """One engine module's adapter, per slice; None where the adapter leaves a slice alone."""

    module: str
    slices: tuple[str, ...]
    lora_A: tuple[Tensor | None, ...]
    lora_B: tuple[Tensor | None, ...]
    scaling: float

    def scaled_lora_B(self) -> tuple[Tensor | None, ...]:
        """lora_B * scaling per slice, as new tensors (the form an engine serves with scaling 1)."""
        return tuple(None if b is None else b * self.scaling for b in self.lora_B)


def pack(adapter: LoraAdapter, packed_modules: Mapping[str, tuple[str, ...]] = PACKED_MODULES) -> dict[str, PackedLora]:
    """Group an adapter's modules the way the engine fuses them.

    Args:
        adapter: the adapter, in Hugging Face module names.
        packed_modules: packed short name -> its slices' short names.

    Returns:
        Engine module name (`model.layers.0.self_attn.qkv_proj`) -> its PackedLora, in the
        adapter's module order; unfused modules keep their name, with one slice.
    """
    member = {s: (packed, i) for packed, slices in packed_modules.items() for i, s in enumerate(slices)}
    out: dict[str, PackedLora] = {}
    for module, w in adapter.modules.items():
        parent, _, short = module.rpartition(".")
        if short not in member:
            out[module] = PackedLora(module, (module,), (w.lora_A,), (w.lora_B,), adapter.scaling)
            continue
        packed, i = member[short]
        name = f"{parent}.{packed}"
        slices = tuple(f"{parent}.{s}" for s in packed_modules[packed])
        prev = out.get(name) or PackedLora(name, slices, (None,) * len(slices), (None,) * len(slices), adapter.scaling)
        out[name] = attrs.evolve(prev, lora_A=_put(prev.lora_A, i, w.lora_A), lora_B=_put(prev.lora_B, i, w.lora_B))
    return out


def _put(items: tuple[Tensor | None, ...], i: int, t: Tensor) -> tuple[Tensor | None, ...]:
    return (*items[:i], t, *items[i + 1:])
