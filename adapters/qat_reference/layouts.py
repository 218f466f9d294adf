"""How a trainer model's parameters map onto the Hugging Face tensors the exporter quantizes.

One layout per kind of model:
- `torch`: plain torch / transformers modules whose parameter names are the checkpoint's
  (`model.layers.0.self_attn.q_proj.weight`, fused 3-D `mlp.experts.gate_up_proj`);
- `megatron`: a Megatron-Core GPTModel on one rank, named through the exporter's mapping
  (`adapters.megatron.hf_names`): the fused `linear_qkv` holds q/k/v (grouped per query group),
  `linear_fc1` holds [gate; up];
- `reference`: the embedded reference model as a trainable module (`EmbeddedModule`), whose
  fused tensors are described by the reference model's own slot table.

A layout also says how each weight's input reaches it: `input` (the owning module's first
argument: nn.Linear, Megatron's parallel linears) or `linear` (a `F.linear` call on the weight
or a view of it inside the module's forward: 3-D expert tensors, the embedded model).
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs
import torch

from adapters.qat_reference.embedded import EmbeddedModule
from domain.errors import QatUnsupportedModel
from domain.quant.qat import HfPart, TrainerTensor

INPUT = "input"
LINEAR = "linear"


class Layout(Protocol):
    @property
    def name(self) -> str: ...

    def root(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def tensors(self, model: torch.nn.Module) -> list[TrainerTensor]: ...

    def site(self, model: torch.nn.Module, tensor: TrainerTensor) -> str: ...

    def check(self, model: torch.nn.Module) -> None: ...


@attrs.frozen
class TorchLayout:
    """Parameter names are the checkpoint names; one part per parameter."""

    name: str = "torch"

    def root(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def tensors(self, model: torch.nn.Module) -> list[TrainerTensor]:
        return [
            TrainerTensor(n, tuple(p.shape), (HfPart(n, tuple(p.shape)),)) for n, p in model.named_parameters()
        ]

    def site(self, model: torch.nn.Module, tensor: TrainerTensor) -> str:
        module = model.get_submodule(tensor.module)
        if tensor.param == "weight" and len(tensor.shape) == 2 and isinstance(module, torch.nn.Linear):
            return INPUT
        return LINEAR

    def check(self, model: torch.nn.Module) -> None:
        return None


# --- Megatron-Core ---------------------------------------------------------------------------


class _RowNumbers:
    """Stands in for a GPTModel in the exporter's mapping: one parameter, holding its row numbers.

    Running `hf_named_weights` on it tells which rows of the Megatron tensor each Hugging Face
    tensor is, so the mapping is the exporter's own (grouped q/k/v, [gate; up]).
    """

    def __init__(self, config: Any, name: str, rows: int) -> None:
        self.config = config
        self._state = {name: torch.arange(rows)}

    def state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        return dict(self._state)


def _row_index(rows: torch.Tensor, total: int) -> tuple[object, ...]:
    if rows.numel() == total and bool((rows == torch.arange(total)).all()):
        return ()
    start = int(rows[0])
    if bool((rows == torch.arange(start, start + rows.numel())).all()):
        return (slice(start, start + rows.numel()),)
    return (rows.clone(),)


def _parallel_sizes() -> dict[str, int]:
    from megatron.core import parallel_state

    sizes = {}
    for name in ("tensor_model_parallel", "pipeline_model_parallel", "expert_model_parallel"):
        getter = getattr(parallel_state, f"get_{name}_world_size", None)
        try:
            sizes[name] = int(getter()) if getter is not None else 1
        except (AssertionError, RuntimeError):
            sizes[name] = 1
    return sizes


@attrs.frozen
class MegatronLayout:
    """A Megatron-Core GPTModel on one rank (tp = pp = ep = 1), named by the exporter's mapping."""

    name: str = "megatron"

    def root(self, model: torch.nn.Module) -> torch.nn.Module:
        """The real GPTModel under wrappers (DDP, Float16Module): parameter names refer to it."""
        while isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module  # type: ignore[assignment]
        return model

    def tensors(self, model: torch.nn.Module) -> list[TrainerTensor]:
        try:
            from adapters.megatron.hf_names import hf_named_weights
        except ModuleNotFoundError as err:  # pragma: no cover - depends on the install
            raise ModuleNotFoundError(
                f"ReferenceQatBackend's Megatron layout needs megatron-core ({err.name})", name=err.name
            ) from err
        out = []
        for name, p in model.named_parameters():
            if p.dim() == 0:
                continue
            parts = []
            config = getattr(model, "config")  # noqa: B009
            for hf, rows in hf_named_weights(_RowNumbers(config, name, p.shape[0])):  # type: ignore[arg-type]
                parts.append(HfPart(hf, (rows.numel(), *p.shape[1:]), _row_index(rows, p.shape[0])))
            out.append(TrainerTensor(name, tuple(p.shape), tuple(parts)))
        return out

    def site(self, model: torch.nn.Module, tensor: TrainerTensor) -> str:
        return INPUT

    def check(self, model: torch.nn.Module) -> None:
        sizes = _parallel_sizes()
        split = {k: v for k, v in sizes.items() if v > 1}
        if split:
            raise QatUnsupportedModel(
                f"the reference QAT backend runs Megatron models on one rank; this one has {split}: "
                "a shard cannot see the whole tensor the exporter quantizes (FP8 blocks, NVFP4 global "
                "scales); use the modelopt QAT backend, or tp = pp = ep = 1"
            )
        if getattr(getattr(model, "config", None), "gradient_accumulation_fusion", False):
            raise QatUnsupportedModel(
                "actor.megatron.override_transformer_config.gradient_accumulation_fusion is true: the fused "
                "wgrad kernel writes into the weight's main_grad, which a fake-quantized weight does not "
                "carry; set it to false for reference-backend QAT"
            )


# --- the embedded reference model --------------------------------------------------------------


@attrs.frozen
class EmbeddedLayout:
    """The embedded reference model as an `EmbeddedModule`: fused tensors from its slot table."""

    name: str = "reference"

    def root(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def tensors(self, model: torch.nn.Module) -> list[TrainerTensor]:
        from adapters.reference.config import hf_weight_shapes
        from adapters.reference.model import slot_table

        cfg = getattr(model, "config")  # noqa: B009 - an EmbeddedModule attribute, not a submodule
        shapes = dict(hf_weight_shapes(cfg))
        parts: dict[str, list[HfPart]] = {}
        for module, slot in slot_table(cfg).items():
            index = (slot.rows,) if slot.expert is None else (slot.expert, slot.rows)
            hf = f"{module}.weight"
            parts.setdefault(slot.key, []).append(HfPart(hf, shapes[hf], index))
        out = []
        for key, members in parts.items():
            name = getattr(model, "param_name")(key)  # noqa: B009
            p = model.get_parameter(name)
            whole = len(members) == 1 and tuple(p.shape) == members[0].shape
            members = [HfPart(members[0].name, members[0].shape)] if whole else members
            out.append(TrainerTensor(name, tuple(p.shape), tuple(members)))
        return out

    def site(self, model: torch.nn.Module, tensor: TrainerTensor) -> str:
        return LINEAR

    def check(self, model: torch.nn.Module) -> None:
        return None


LAYOUTS: dict[str, Layout] = {"torch": TorchLayout(), "megatron": MegatronLayout(), "reference": EmbeddedLayout()}


def is_megatron_model(model: torch.nn.Module) -> bool:
    """True for Megatron-Core modules (judged by the class's module path, without importing megatron)."""
    return type(model).__module__.startswith("megatron.")


def select_layout(model: torch.nn.Module, choice: str = "auto") -> Layout:
    """The layout for `model`: `auto` picks megatron / reference / torch by the model's type.

    Args:
        model: the trainer model.
        choice: "auto", "torch", "megatron" or "reference".

    Returns:
        The Layout. Raises QatUnsupportedModel for an unknown choice.
    """
    if choice == "auto":
        if is_megatron_model(model):
            choice = "megatron"
        elif isinstance(model, EmbeddedModule):
            choice = "reference"
        else:
            choice = "torch"
    try:
        return LAYOUTS[choice]
    except KeyError:
        raise QatUnsupportedModel(f"unknown QAT layout {choice!r}; valid: auto, {', '.join(LAYOUTS)}") from None


def weight_shapes(model: torch.nn.Module, layout: str = "auto") -> list[tuple[str, tuple[int, ...]]]:
    """The (Hugging Face name, shape) of every weight QAT covers, through the model's name mapping.

    Args:
        model: the trainer model.
        layout: "auto", "torch", "megatron" or "reference" (see select_layout).
    """
    chosen = select_layout(model, layout)
    return [(p.name, p.shape) for t in chosen.tensors(chosen.root(model)) for p in t.parts]
