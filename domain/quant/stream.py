"""Trainer-side export: turn (name, weight) pairs into the rollout's checkpoint tensors.

`quantize_stream` walks the model's export units (`domain.quant.units`) and emits each unit's
checkpoint tensors; it holds at most the pending fused groups, never the whole model. The names
and shapes those tensors will have are known before anything is computed (`checkpoint_specs`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import attrs
import torch

from domain.quant import modelopt_layout, naming
from domain.quant.formats import NVFP4, ElementType, PrecisionFormat, ScaleEncoding
from domain.quant.plan import QuantizationPlan, TensorDecision
from domain.quant.units import Unit, export_units

Tensor = torch.Tensor


def checkpoint_names(plan: QuantizationPlan, decision: TensorDecision, shape: tuple[int, ...]) -> tuple[str, ...]:
    """Names of the checkpoint tensors one decided tensor becomes.

    Args:
        plan: the quantization plan (for the scale's name).
        decision: the tensor's decision.
        shape: the tensor's shape.

    Returns:
        Full checkpoint names, e.g. (`...q_proj.weight_packed`, `...q_proj.weight_scale`, ...).
        A fused 3-D expert tensor becomes every expert's tensors.
    """
    if not decision.is_quantized:
        return (decision.name,)
    if len(shape) == 3:
        modules = [m for m, _, _ in naming.expert_split(decision.name, tuple(shape))]
    else:
        modules = [naming.module_name(decision.name)]
    return tuple(_stored(plan, decision.format, m, f"{m}.{_local(plan, n)}")
                 for m in modules for n in decision.format.tensor_names)


@attrs.frozen
class TensorSpec:
    """One checkpoint tensor, before it exists: name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


_ELEMENT_DTYPE = {ElementType.E4M3: torch.float8_e4m3fn, ElementType.E2M1: torch.uint8}
_SCALE_DTYPE = {
    ScaleEncoding.FP32: torch.float32,
    ScaleEncoding.E8M0: torch.uint8,
    ScaleEncoding.E4M3_GLOBAL_FP32: torch.float8_e4m3fn,
}


def format_specs(fmt: PrecisionFormat, module: str, shape: tuple[int, int], scale_name: str = "weight_scale") -> list[TensorSpec]:
    """The checkpoint tensors one [N, K] weight of module `module` becomes in `fmt`.

    Args:
        fmt: a quantized preset.
        module: the module name (`model.layers.0.self_attn.q_proj`).
        shape: the weight's logical shape [N, K].
        scale_name: `weight_scale` (compressed-tensors) or `weight_scale_inv` (native layouts).

    Returns:
        The specs: elements, block scale and, for NVFP4, the global scale.
    """
    n, k = shape
    specs = [
        TensorSpec(f"{module}.{fmt.weight_name}", _ELEMENT_DTYPE[fmt.element], (n, k // 2) if fmt.packed else (n, k)),
        TensorSpec(f"{module}.{scale_name}", _SCALE_DTYPE[fmt.scale_encoding], fmt.scale_shape((n, k))),
    ]
    if fmt.has_global_scale:
        specs.append(TensorSpec(f"{module}.weight_global_scale", torch.float32, (1,)))
    return specs


def _format_specs(plan: QuantizationPlan, fmt: PrecisionFormat, module: str, shape: tuple[int, ...]) -> list[TensorSpec]:
    n, k = shape
    specs = format_specs(fmt, module, (n, k), plan.scale_name)
    if not _modelopt(plan, fmt, module):
        return specs
    return [TensorSpec(modelopt_layout.rename(s.name), s.dtype, () if s.name.endswith(".weight_global_scale") else s.shape)
            for s in specs]


def _modelopt(plan: QuantizationPlan, fmt: PrecisionFormat, module: str) -> bool:
    """Whether `module`'s tensors take ModelOpt's NVFP4 names: the plan's experts, in that layout."""
    return plan.expert_layout == "modelopt" and fmt.name == NVFP4.name and naming.experts_layer(module) is not None


def _stored(plan: QuantizationPlan, fmt: PrecisionFormat, module: str, name: str) -> str:
    return modelopt_layout.rename(name) if _modelopt(plan, fmt, module) else name


def checkpoint_specs(
    plan: QuantizationPlan, name: str, shape: tuple[int, ...], dtype: torch.dtype
) -> list[TensorSpec]:
    """The checkpoint tensors one source tensor becomes, known before anything is computed.

    Args:
        plan: the quantization plan.
        name: the source tensor's name.
        shape: its shape.
        dtype: its dtype.

    Returns:
        Every output (name, dtype, shape): what `quantize_stream` yields for this tensor (a fused
        NVFP4 group's members are yielded later, together, but with these specs).
    """
    d = plan.decide(name, tuple(shape))
    if not d.is_quantized:
        return [TensorSpec(name, dtype, tuple(shape))]
    if len(shape) == 3:
        return [
            spec
            for module, _, rows in naming.expert_split(name, tuple(shape))
            for spec in _format_specs(plan, d.format, module, (rows.stop - rows.start, shape[-1]))
        ]
    return _format_specs(plan, d.format, naming.module_name(name), tuple(shape))


def _local(plan: QuantizationPlan, local: str) -> str:
    return plan.scale_name if local == "weight_scale" else local


def _quantize(plan: QuantizationPlan, fmt: PrecisionFormat, w: Tensor, name: str, global_scale: Tensor | None) -> dict[str, Tensor]:
    from domain.quant.codecs import quantize_weight  # bounds its own scratch memory (row chunks)

    return quantize_weight(fmt, w, name=name, global_scale=global_scale, numerics=plan.numerics,
                          scale_rule=plan.scale_rule).tensors


def _emit(plan: QuantizationPlan, module: str, weight: Tensor, fmt, global_scale=None) -> Iterator[tuple[str, Tensor]]:
    tensors = _quantize(plan, fmt, weight, f"{module}.weight", global_scale)
    if _modelopt(plan, fmt, module):
        tensors = modelopt_layout.modelopt_tensors(tensors)
    for local, tensor in tensors.items():
        yield f"{module}.{_local(plan, local)}", tensor


def _emit_fused_experts(plan: QuantizationPlan, d: TensorDecision, w: Tensor) -> Iterator[tuple[str, Tensor]]:
    from domain.quant.codecs import nvfp4_global_scale

    split = naming.expert_split(d.name, tuple(w.shape))
    gate_up = split[0][0].endswith("gate_proj")
    scales = None
    if d.format.has_global_scale and gate_up:
        # gate and up of one expert share one global scale: the amax over both halves.
        scales = nvfp4_global_scale(w, name=d.name, numerics=plan.numerics)  # [E, 1]
    for module, e, rows in split:
        gs = scales[e] if scales is not None else None
        yield from _emit(plan, module, w[e, rows], d.format, gs)


def emit_unit(plan: QuantizationPlan, unit: Unit[Tensor]) -> Iterator[tuple[str, Tensor]]:
    """One export unit's checkpoint tensors.

    Args:
        plan: the quantization plan.
        unit: the unit (`domain.quant.units.export_units` over (name, shape, tensor) items).

    Returns:
        (checkpoint name, tensor): a BF16 tensor as it is; a fused group's members with one global
        scale computed over the whole group; a fused 3-D expert tensor as per-expert tensors;
        any other quantized tensor as its format's tensors.
    """
    if unit.group is not None:
        from domain.quant.codecs import nvfp4_global_scale

        gs = nvfp4_global_scale(*unit.values, name=unit.group, numerics=plan.numerics)
        for d, w in unit.items:
            yield from _emit(plan, naming.module_name(d.name), w, d.format, gs)
        return
    (d, tensor), = unit.items
    if not d.is_quantized:
        yield d.name, tensor
    elif tensor.dim() == 3:
        yield from _emit_fused_experts(plan, d, tensor)
    else:
        yield from _emit(plan, naming.module_name(d.name), tensor, d.format)


def quantize_stream(plan: QuantizationPlan, named_tensors: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """Quantize a model's weights into checkpoint-format tensors, one tensor at a time.

    Args:
        plan: the quantization plan.
        named_tensors: (Hugging Face name, tensor) pairs in layer order.

    Returns:
        An iterator of (checkpoint name, tensor) in the input's layer order, unit by unit
        (`domain.quant.units`): BF16 tensors pass through unchanged; quantized ones become
        `weight` / `weight_packed`, `weight_scale` (or `weight_scale_inv`) and, for NVFP4,
        `weight_global_scale`; a fused NVFP4 group (q/k/v, gate/up) is emitted once complete, with
        one global scale over the whole group; a fused 3-D expert tensor becomes per-expert
        tensors (`experts.N.gate_proj...`). Holds at most the pending fused groups, never the model.
        Raises NonDivisibleTensors (BlockDivisibility) and the codecs' InvalidTensor errors, naming the tensor.
    """
    for unit in export_units(plan, _shaped(named_tensors)):
        yield from emit_unit(plan, unit)
        del unit  # its tensors are not alive while the next unit is read


def _shaped(named_tensors: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, tuple[int, ...], Tensor]]:
    for name, t in named_tensors:
        yield name, tuple(t.shape), t
        del t
