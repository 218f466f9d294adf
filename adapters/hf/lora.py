"""A PEFT-wrapped `transformers` model as a LoRA source: its adapter and its base weights.

`adapter_from_peft(model)` reads the LoRA layers PEFT put in the model (`peft.tuners.lora.Linear`:
`lora_A[name]` / `lora_B[name]`, `r`, `lora_alpha`, `use_rslora`) into a `domain.lora.LoraAdapter`
whose module names are the base model's (`model.layers.0.self_attn.q_proj`), so that
`named_tensors()` gives exactly the names `save_pretrained` writes. `base_weights(model)` yields
the base model's weights without the adapter (PEFT's `.base_layer` removed from the names).

PEFT is read through its modules' attributes, not imported: a plain `transformers` model with
PEFT layers injected (`inject_adapter_in_model`) works too. Variants the refit does not carry
(DoRA, lora_bias, fan_in_fan_out, embedding or conv LoRA, per-module rank or alpha patterns,
modules_to_save)
are refused with `LoraUnsupported`, naming the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import torch

from adapters.hf.module import HfModuleTrainer
from adapters.hf.names import checkpoint_names
from domain.lora import LoraAdapter, LoraUnsupported, LoraWeights, merged_stream

_BASE = ".base_layer"


def _inner(model: Any) -> Any:
    """The transformers model inside a PeftModel (`model.base_model.model`), or `model` itself."""
    tuner = getattr(model, "base_model", None)
    inner = getattr(tuner, "model", None)
    return inner if isinstance(inner, torch.nn.Module) and hasattr(model, "peft_config") else model


def _config(model: Any, adapter_name: str) -> Any:
    configs = getattr(model, "peft_config", None) or getattr(_inner(model), "peft_config", None) or {}
    if adapter_name not in configs:
        raise LoraUnsupported("*", f"the model has no PEFT adapter named {adapter_name!r} "
                              f"(it has {sorted(configs)})", "pass adapter_name")
    return configs[adapter_name]


def _lora_layers(model: Any, adapter_name: str) -> Iterator[tuple[str, Any]]:
    for name, module in _inner(model).named_modules():
        lora_a = getattr(module, "lora_A", None)
        if isinstance(lora_a, torch.nn.ModuleDict) and adapter_name in lora_a:
            yield name, module
        elif adapter_name in (getattr(module, "lora_embedding_A", None) or {}):
            raise LoraUnsupported(name, "embedding LoRA is not carried by the refit", "target linear layers only")


def _refuse_variants(name: str, layer: Any, adapter_name: str, r: int, alpha: float) -> None:
    if not isinstance(layer.lora_A[adapter_name], torch.nn.Linear):
        raise LoraUnsupported(name, f"{type(layer.lora_A[adapter_name]).__name__} LoRA is not carried",
                              "target linear layers only")
    if getattr(layer, "use_dora", {}).get(adapter_name, False) or adapter_name in getattr(layer, "lora_variant", {}):
        raise LoraUnsupported(name, "DoRA and other LoRA variants are not carried", "train plain LoRA")
    if getattr(layer, "lora_bias", {}).get(adapter_name, False):
        raise LoraUnsupported(name, "lora_bias is not carried", "set lora_bias=False")
    if getattr(layer, "fan_in_fan_out", False):
        raise LoraUnsupported(name, "fan_in_fan_out (Conv1D) layers are not carried", "use nn.Linear models")
    if layer.r[adapter_name] != r or layer.lora_alpha[adapter_name] != alpha:
        raise LoraUnsupported(name, f"rank {layer.r[adapter_name]} / alpha {layer.lora_alpha[adapter_name]} differ "
                              f"from the adapter's r={r} / lora_alpha={alpha} (rank_pattern or alpha_pattern)",
                              "use one r and lora_alpha for every module")


def adapter_from_peft(model: torch.nn.Module, adapter_name: str = "default") -> LoraAdapter:
    """The adapter of a PEFT-wrapped model, in the base model's module names.

    Args:
        model: a `PeftModel` (or a transformers model with PEFT LoRA layers injected).
        adapter_name: PEFT's adapter name.

    Returns:
        A LoraAdapter whose tensors are the model's own (detached, not copied).

    Raises:
        LoraUnsupported: a variant the refit does not carry, naming the module.
        LoraRankMismatch, LoraShapeMismatch, LoraNonFinite, LoraUnknownTarget: the adapter's checks.
    """
    cfg = _config(model, adapter_name)
    r, alpha = int(cfg.r), float(cfg.lora_alpha)
    if getattr(cfg, "modules_to_save", None):
        raise LoraUnsupported(",".join(cfg.modules_to_save), "modules_to_save (fully trained modules next to the "
                              "adapter) is not carried", "train those modules as LoRA targets or leave them frozen")
    modules: dict[str, LoraWeights] = {}
    for name, layer in _lora_layers(model, adapter_name):
        _refuse_variants(name, layer, adapter_name, r, alpha)
        modules[name] = LoraWeights(layer.lora_A[adapter_name].weight.detach(), layer.lora_B[adapter_name].weight.detach())
    targets = sorted({m.rsplit(".", 1)[-1] for m in modules})
    return LoraAdapter(r=r, lora_alpha=alpha, target_modules=tuple(targets), modules=modules,
                       use_rslora=bool(getattr(cfg, "use_rslora", False)))


def base_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's parameters without the adapter, in the base model's names.

    Args:
        model: a PEFT-wrapped model.

    Returns:
        (name, tensor) pairs, detached, in `named_parameters` order; LoRA tensors left out and
        PEFT's `.base_layer` removed (`model.layers.0.self_attn.q_proj.weight`).
    """
    for name, p in _inner(model).named_parameters():
        if ".lora_" in name or "lora_magnitude_vector" in name:
            continue
        yield name.replace(_BASE, ""), p.detach()


@attrs.define
class PeftBase:
    """The base model inside a PEFT-wrapped model, as a TrainerModel: its weights without the adapter
    (checkpoint names, fused experts per expert), its forward with the adapter disabled."""

    model: Any

    @property
    def config(self) -> Any:
        return _inner(self.model).config

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return checkpoint_names(base_weights(self.model))

    def log_probs(self, input_ids: torch.Tensor, *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        with self.model.disable_adapter():
            return HfModuleTrainer(self.model).log_probs(input_ids, temperature=temperature)


@attrs.define
class PeftTrainer:
    """A PEFT-wrapped `transformers` model as a LoRA trainer (`actor.strategy: hf`, `model=` a
    PeftModel): `base` and `adapter` apart for the adapter mode (`adapter` reads the model's current
    lora_A / lora_B at every access), and as a TrainerModel the merged model for the merged mode
    (PEFT's merge, bit for bit, one weight at a time; the model is never merged in place)."""

    model: Any
    adapter_name: str = "default"

    @property
    def config(self) -> Any:
        return _inner(self.model).config

    @property
    def adapter(self) -> LoraAdapter:
        return adapter_from_peft(self.model, self.adapter_name)

    @property
    def base(self) -> PeftBase:
        return PeftBase(self.model)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return merged_stream(self.base.named_weights(), self.adapter)

    def log_probs(self, input_ids: torch.Tensor, *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The PEFT model's own forward (base + adapter)."""
        return HfModuleTrainer(self.model).log_probs(input_ids, temperature=temperature)


def is_peft_model(model: object) -> bool:
    """A PEFT-wrapped model (it carries PEFT's `peft_config`)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")
