"""The embedded trainer with a LoRA adapter: a frozen base and a trainable adapter, as a LoRA RL
run holds them.

`LoraTrainer` is a TrainerModel in both of `actor.lora.sync`'s senses:
- `named_weights()` is the merged model (`domain.lora.merged_stream`: W + (alpha/r)·B·A, PEFT's
  expression, one weight at a time), what the merged mode quantizes and refits;
- `base` and `adapter` are the two halves the adapter mode sends apart.

Training-like steps (`perturb_`) move the adapter only; the base stays as it was loaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import attrs
import torch

from adapters.reference.config import ReferenceModelConfig
from adapters.reference.trainer import ReferenceTrainer, perturb_tensors_
from domain.lora import LoraAdapter, LoraWeights, merged_stream

# PEFT's names of the projections a Qwen3 decoder layer has (attention and dense MLP).
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ALL_TARGETS = ATTENTION_TARGETS + MLP_TARGETS


def random_adapter(shapes: Iterable[tuple[str, tuple[int, ...]]], *, r: int,
                   lora_alpha: float | None = None, targets: Iterable[str] = ALL_TARGETS, seed: int = 0,
                   dtype: torch.dtype = torch.bfloat16) -> LoraAdapter:
    """A seeded adapter over every targeted projection of the model (expert projections left out).

    lora_A is PEFT's Kaiming-uniform start; lora_B is small random noise rather than PEFT's zeros,
    so that the merged model differs from the base from the first refit on.

    Args:
        shapes: the base model's (Hugging Face name, shape) pairs.
        r: the rank.
        lora_alpha: PEFT's lora_alpha (default: 2·r).
        targets: short module names to adapt.
        seed: the generator's seed.
        dtype: the adapter's dtype.
    """
    targets = tuple(targets)
    g = torch.Generator().manual_seed(seed)
    modules: dict[str, LoraWeights] = {}
    for name, shape in shapes:
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in targets or ".experts." in module:
            continue
        n, k = shape
        bound = (1.0 / k) ** 0.5
        a = (torch.rand((r, k), generator=g) * 2 - 1) * bound
        b = torch.randn((n, r), generator=g) * 0.02
        modules[module] = LoraWeights(a.to(dtype), b.to(dtype))
    return LoraAdapter(r=r, lora_alpha=float(2 * r if lora_alpha is None else lora_alpha),
                       target_modules=targets, modules=modules)


@attrs.define
class LoraTrainer:
    """The embedded trainer with an adapter (TrainerModel over the merged model).

    Attributes:
        base: the frozen base model.
        adapter: the trainable adapter (its tensors move in place with `perturb_`).
    """

    base: ReferenceTrainer
    adapter: LoraAdapter

    @classmethod
    def from_seed(cls, base: ReferenceTrainer, *, r: int, lora_alpha: float | None = None,
                  targets: Iterable[str] = ALL_TARGETS, seed: int = 0) -> LoraTrainer:
        """A random adapter of rank `r` over `base` (seeded)."""
        shapes = [(n, tuple(t.shape)) for n, t in base.named_weights()]
        return cls(base, random_adapter(shapes, r=r, lora_alpha=lora_alpha, targets=targets,
                                        seed=seed + 7_919))

    @property
    def config(self) -> ReferenceModelConfig:
        return self.base.config

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The merged model's (Hugging Face name, tensor), in layer order."""
        return merged_stream(self.base.named_weights(), self.adapter)

    def num_bytes(self) -> int:
        return self.base.num_bytes()

    def merged(self) -> ReferenceTrainer:
        """The merged model as a trainer of its own (a copy)."""
        return ReferenceTrainer.from_hf_weights(self.config, self.named_weights())

    def log_probs(self, input_ids: torch.Tensor, *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The merged model's log-probs and entropies (TrainerModel port)."""
        return self.merged().log_probs(input_ids, temperature=temperature)

    def _tensors(self) -> list[torch.Tensor]:
        return [t for w in self.adapter.modules.values() for t in (w.lora_A, w.lora_B)]

    def snapshot(self) -> list[torch.Tensor]:
        """A copy of the adapter's tensors (`restore_` puts them back)."""
        return [t.clone() for t in self._tensors()]

    @torch.no_grad()
    def restore_(self, snapshot: list[torch.Tensor]) -> None:
        for t, saved in zip(self._tensors(), snapshot, strict=True):
            t.copy_(saved)

    @torch.no_grad()
    def perturb_(self, seed: int, scale: float = 0.01) -> None:
        """A training-like step on the adapter only: every lora_A and lora_B moves in place."""
        perturb_tensors_(self._tensors(), seed, scale)
