"""A LoRA adapter as a value: per target module `lora_A` [r, K] and `lora_B` [N, r], in PEFT's names.

PEFT saves an adapter as `<prefix><module>.lora_A.weight` / `.lora_B.weight` (prefix
`base_model.model.` in `save_pretrained`'s safetensors), with `r`, `lora_alpha`, `use_rslora` and
`target_modules` in `adapter_config.json`. The scaling is PEFT's: `lora_alpha / r`, or
`lora_alpha / sqrt(r)` with rsLoRA. It is applied once, where the adapter is used (the merge, or
the engine); the tensors here are never pre-scaled.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping

import attrs
import torch

from domain.errors import LoraNonFinite, LoraRankMismatch, LoraShapeMismatch, LoraUnknownTarget

Tensor = torch.Tensor

PEFT_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"


@attrs.frozen(eq=False)  # tensors: identity, not elementwise, equality
class LoraWeights:
    """One module's adapter: `lora_A` [r, K] and `lora_B` [N, r]."""

    lora_A: Tensor
    lora_B: Tensor

    @property
    def nbytes(self) -> int:
        return self.lora_A.numel() * self.lora_A.element_size() + self.lora_B.numel() * self.lora_B.element_size()


def _names(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(names)


def _short(module: str) -> str:
    return module.rsplit(".", 1)[-1]


def _check_module(module: str, w: LoraWeights, r: int, targets: tuple[str, ...]) -> None:
    if _short(module) not in targets:
        raise LoraUnknownTarget(module, f"{_short(module)!r} is not in target_modules {list(targets)}",
                                "add it to target_modules or drop its tensors")
    a, b = w.lora_A, w.lora_B
    if a.dim() != 2 or b.dim() != 2:
        raise LoraShapeMismatch(module, f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} must be 2-D "
                                "([r, in_features] and [out_features, r])")
    if a.shape[0] != r or b.shape[1] != r:
        raise LoraRankMismatch(module, f"lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} have rank "
                               f"{a.shape[0]}/{b.shape[1]}, the adapter's r is {r}",
                               "set r to the rank the tensors were trained with")
    for label, t in (("lora_A", a), ("lora_B", b)):
        if not bool(torch.isfinite(t).all()):
            raise LoraNonFinite(module, f"{label} holds NaN or Inf values",
                                "do not sync a diverged adapter: roll back to the last good step")


@attrs.frozen(eq=False)  # tensors: identity, not elementwise, equality
class LoraAdapter:
    """A LoRA adapter: its configuration and, per full module name, its weights.

    Args:
        r: the rank.
        lora_alpha: PEFT's `lora_alpha`.
        target_modules: the short module names the adapter targets (`q_proj`, `down_proj`, ...).
        modules: full module name (`model.layers.0.self_attn.q_proj`) -> its weights.
        use_rslora: scale by `lora_alpha / sqrt(r)` instead of `lora_alpha / r`.

    Raises:
        LoraRankMismatch, LoraShapeMismatch, LoraNonFinite, LoraUnknownTarget: naming the module.
    """

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] = attrs.field(converter=_names)
    modules: Mapping[str, LoraWeights]
    use_rslora: bool = False

    def __attrs_post_init__(self) -> None:
        if self.r <= 0:
            raise LoraRankMismatch("*", f"r must be a positive integer, not {self.r}")
        for module, w in self.modules.items():
            _check_module(module, w, self.r, self.target_modules)

    @property
    def scaling(self) -> float:
        """PEFT's `LoraLayer.update_layer`: alpha / sqrt(r) with rsLoRA, else alpha / r."""
        return self.lora_alpha / math.sqrt(self.r) if self.use_rslora else self.lora_alpha / self.r

    @property
    def nbytes(self) -> int:
        """The adapter's own bytes (every lora_A and lora_B)."""
        return sum(w.nbytes for w in self.modules.values())

    def named_tensors(self, prefix: str = PEFT_PREFIX) -> Iterator[tuple[str, Tensor]]:
        """The tensors in PEFT's names (`save_pretrained`'s, with the default prefix)."""
        for module, w in self.modules.items():
            yield f"{prefix}{module}{_A}", w.lora_A
            yield f"{prefix}{module}{_B}", w.lora_B

    def check_base(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Check every module against the base model's weight shapes.

        Args:
            shapes: base weight name (`<module>.weight`) -> shape [N, K].

        Raises:
            LoraUnknownTarget: a module has no weight in the base model.
            LoraShapeMismatch: lora_B @ lora_A is not the base weight's shape.
        """
        for module, w in self.modules.items():
            shape = shapes.get(f"{module}.weight")
            if shape is None:
                raise LoraUnknownTarget(module, "the base model has no such weight",
                                        "load the adapter on the model it was trained on")
            check_fits(module, w, tuple(shape))

    @classmethod
    def from_named_tensors(cls, tensors: Mapping[str, Tensor], *, r: int, lora_alpha: float,
                           target_modules: Iterable[str], use_rslora: bool = False,
                           prefix: str = PEFT_PREFIX) -> LoraAdapter:
        """Build an adapter from PEFT's names (`<prefix><module>.lora_A.weight` / `.lora_B.weight`).

        Raises:
            LoraShapeMismatch: a module has lora_A without lora_B (or the reverse), or a name is not
                PEFT's.
        """
        found: dict[str, dict[str, Tensor]] = {}
        for name, t in tensors.items():
            body = name.removeprefix(prefix)
            for suffix in (_A, _B):
                if body.endswith(suffix):
                    found.setdefault(body.removesuffix(suffix), {})[suffix] = t
                    break
            else:
                raise LoraShapeMismatch(name, f"not a PEFT LoRA tensor name (<module>{_A} or <module>{_B})")
        modules = {}
        for module, parts in found.items():
            if set(parts) != {_A, _B}:
                missing = "lora_B" if _A in parts else "lora_A"
                raise LoraShapeMismatch(module, f"{missing} is missing", "save both tensors of every module")
            modules[module] = LoraWeights(parts[_A], parts[_B])
        return cls(r=r, lora_alpha=lora_alpha, target_modules=target_modules, modules=modules,
                   use_rslora=use_rslora)


def check_fits(module: str, w: LoraWeights, shape: tuple[int, ...]) -> None:
    """Raise LoraShapeMismatch unless lora_B @ lora_A has the base weight's shape [N, K]."""
    if len(shape) != 2 or (w.lora_B.shape[0], w.lora_A.shape[1]) != shape:
        raise LoraShapeMismatch(module, f"lora_B {tuple(w.lora_B.shape)} @ lora_A {tuple(w.lora_A.shape)} "
                                f"does not fit the base weight {tuple(shape)}",
                                "the adapter was trained on another model or layout")
