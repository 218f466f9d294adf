"""The trainer side of the embedded default: the reference model with random weights from a seed."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import attrs
import torch

from adapters.reference.config import ReferenceModelConfig, hf_weight_shapes
from adapters.reference.model import (
    check_input_ids,
    forward_logits,
    fused_shapes,
    log_probs_from_logits,
    slot_table,
)

_NORM_KEYS = ("input_norm", "post_norm", "q_norm", "k_norm", "norm")


def init_weights(cfg: ReferenceModelConfig, seed: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random weights in the fused layout, reproducible from `seed`.

    Norm weights are 1 + small noise; embeddings and the LM head have `embed_std` (so that the
    next-token distributions are far from uniform); other Linear weights have `init_std`.

    Args:
        cfg: the model configuration.
        seed: the random seed.
        dtype: the trainer's dtype.

    Returns:
        key -> tensor, in layer order.
    """
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for key, shape in fused_shapes(cfg).items():
        leaf = key.rsplit(".", 1)[-1]
        noise = torch.randn(shape, generator=g)
        if leaf in _NORM_KEYS:
            t = 1.0 + 0.1 * noise
        elif leaf in ("embed", "lm_head"):
            t = cfg.embed_std * noise / cfg.hidden_size**0.5 if leaf == "lm_head" else cfg.embed_std * noise
        else:
            t = cfg.init_std * noise
        out[key] = t.to(dtype)
    return out


@attrs.define
class ReferenceTrainer:
    """A TrainerModel: the reference model's weights, as a trainer holds them (BF16, fused).

    Attributes:
        config: the model configuration.
        weights: fused key -> parameter tensor.
    """

    config: ReferenceModelConfig
    weights: dict[str, torch.Tensor]

    @classmethod
    def from_seed(cls, config: ReferenceModelConfig, seed: int = 0) -> ReferenceTrainer:
        """A trainer with random weights from `seed` (no download, no checkpoint)."""
        return cls(config, init_weights(config, seed))

    @classmethod
    def from_hf_weights(cls, config: ReferenceModelConfig, named: Iterable[tuple[str, torch.Tensor]],
                        dtype: torch.dtype = torch.bfloat16, *, tied: bool = False) -> ReferenceTrainer:
        """A trainer holding a checkpoint's weights (Hugging Face names) in the fused layout.

        A tied checkpoint (`tied`) has no `lm_head.weight`: the reference model has no tied head,
        so its head starts as a copy of the embeddings (training-like steps then move the two
        apart). An untied one must hold its head.

        Raises:
            CheckpointError: a tensor the model has no place for, of the wrong shape, or missing.
        """
        from domain.errors import CheckpointError

        weights = {key: torch.zeros(shape, dtype=dtype) for key, shape in fused_shapes(config).items()}
        table, seen = slot_table(config), set()
        for name, t in named:
            slot = table.get(name.removesuffix(".weight"))
            if slot is None:
                raise CheckpointError(f"tensor {name!r} has no place in the reference model ({config.num_layers} "
                                      "layers of Qwen3 / Qwen3-MoE)")
            target = weights[slot.key] if slot.expert is None else weights[slot.key][slot.expert]
            if tuple(target[slot.rows].shape) != tuple(t.shape):
                raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}; the config says "
                                      f"{tuple(target[slot.rows].shape)}")
            target[slot.rows].copy_(t)
            seen.add(name.removesuffix(".weight"))
        if tied and "lm_head" not in seen and "model.embed_tokens" in seen:
            weights["lm_head"].copy_(weights["embed"])
            seen.add("lm_head")
        missing = sorted(set(table) - seen)
        if missing:
            raise CheckpointError(f"the checkpoint lacks {len(missing)} tensors the config needs, e.g. "
                                  f"{[m + '.weight' for m in missing[:3]]}")
        return cls(config, weights)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor) in layer order; fused tensors are yielded as views."""
        for module, slot in slot_table(self.config).items():
            t = self.weights[slot.key]
            if slot.expert is not None:
                t = t[slot.expert]
            yield f"{module}.weight", t[slot.rows]

    def num_bytes(self) -> int:
        """Bytes of every weight, as the refit reads them."""
        return sum(t.numel() * t.element_size() for t in self.weights.values())

    def log_probs(self, input_ids: torch.Tensor, *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of each next token and entropies, float32 [B, T - 1] on the host (TrainerModel
        port), computed where the weights are."""
        check_input_ids(self.config, input_ids)
        ids = input_ids.to(next(iter(self.weights.values())).device)
        logits = forward_logits(self.config, self.weights, ids)
        logp, entropy = log_probs_from_logits(logits, ids, temperature)
        return logp.cpu(), entropy.cpu()

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of every weight (`restore_` puts it back)."""
        return {k: t.clone() for k, t in self.weights.items()}

    @torch.no_grad()
    def restore_(self, snapshot: dict[str, torch.Tensor]) -> None:
        """Copy a `snapshot()` back into the weights, in place."""
        for k, t in self.weights.items():
            t.copy_(snapshot[k])

    @torch.no_grad()
    def perturb_(self, seed: int, scale: float = 0.01) -> None:
        """A training-like step: every weight w += scale * rms(w) * noise, in place.

        The root mean square (not the standard deviation) sets the size, so that norm weights
        near 1 move by more than one BF16 step too.

        Args:
            seed: seed of the noise (one per step).
            scale: size of the step relative to each tensor's magnitude.
        """
        perturb_tensors_(self.weights.values(), seed, scale)


@torch.no_grad()
def perturb_tensors_(tensors: Iterable[torch.Tensor], seed: int, scale: float) -> None:
    """A training-like step on tensors in place: w += scale * rms(w) * noise (one generator from
    `seed`, drawn tensor after tensor in the given order).

    Args:
        tensors: the weights, each once.
        seed: seed of the noise.
        scale: size of the step relative to each tensor's root mean square.
    """
    g = torch.Generator().manual_seed(seed)
    for t in tensors:
        noise = torch.randn(t.shape, generator=g)
        # Accumulated in float64, so the float32 result does not depend on how many threads
        # split the reduction: every process of a world perturbs to the same bits.
        rms = t.double().pow(2).mean().sqrt().float()
        t.add_((scale * rms * noise).to(t.dtype))


@attrs.define
class AdamLikeSteps:
    """Training-like updates the way an Adam optimizer makes them: FP32 master weights move by
    +-lr per element (Adam's normalized step), then the trainer's weights are the masters in their
    own dtype (BF16), in place. Most +-1e-6 steps do not move a BF16 weight; a few cross a
    rounding boundary, which is what a delta refit sends.

    Attributes:
        tensors: the trainer's weights (updated in place).
        masters: their FP32 masters (made from them at construction).
    """

    tensors: list[torch.Tensor]
    masters: list[torch.Tensor] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.masters = [t.detach().float().clone() for t in self.tensors]

    @classmethod
    def of(cls, weights: Iterable[torch.Tensor]) -> AdamLikeSteps:
        return cls(list(weights))

    @torch.no_grad()
    def step_(self, seed: int, lr: float) -> None:
        """One step: every master element += lr or -= lr (signs from `seed`), then the weights."""
        g = torch.Generator().manual_seed(seed)
        for t, m in zip(self.tensors, self.masters, strict=True):
            _signed_step_(t, m, g, lr)


def _signed_step_(t: torch.Tensor, master: torch.Tensor, g: torch.Generator, lr: float) -> None:
    sign = torch.randint(0, 2, master.shape, generator=g, dtype=torch.int8).float().mul_(2).sub_(1)
    master.add_(sign, alpha=lr)
    t.copy_(master)


@torch.no_grad()
def adam_like_step_(tensors: Iterable[torch.Tensor], seed: int, lr: float) -> None:
    """One AdamLikeSteps step from masters equal to the weights themselves, holding no masters
    (one tensor's FP32 copy at a time): the first step of a run, for large models.

    Args:
        tensors: the trainer's weights (updated in place).
        seed: seed of the signs.
        lr: the step per element.
    """
    g = torch.Generator().manual_seed(seed)
    for t in tensors:
        _signed_step_(t, t.float(), g, lr)


def hf_state_dict(trainer: ReferenceTrainer) -> dict[str, torch.Tensor]:
    """The trainer's weights as a Hugging Face state dict (copies), e.g. for transformers."""
    return {name: t.clone() for name, t in trainer.named_weights()}


__all__ = ["ReferenceTrainer", "hf_state_dict", "hf_weight_shapes", "init_weights", "perturb_tensors_"]
