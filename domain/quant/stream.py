"""Trainer-side export: turn (name, weight) pairs into the rollout's checkpoint tensors.

`quantize_stream` is a generator: it holds at most one pending fused group per format-with-a-
global-scale (NVFP4 q/k/v or gate/up) and never the whole model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import attrs
import torch

from domain.errors import NonDivisibleTensors
from domain.quant import naming
from domain.quant.formats import ElementType, PrecisionFormat, ScaleEncoding
from domain.quant.plan import QuantizationPlan, TensorDecision

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
    locals_ = tuple(_local(plan, n) for n in decision.format.tensor_names)
    return tuple(f"{m}.{loc}" for m in modules for loc in locals_)


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
    return format_specs(fmt, module, (n, k), plan.scale_name)


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


def misaligned_pattern(module: str) -> str:
    """The ignore entry that keeps every module of this projection type in BF16 (rule-9 hint).

    Args:
        module: the module name, e.g. `model.layers.3.linear_attn.in_proj_ba`.

    Returns:
        A `re:` entry matching the projection's name in every layer, e.g. `re:.*\\.in_proj_ba$`.
    """
    return f"re:.*\\.{module.rsplit('.', 1)[-1]}$"


def check_divisible(decision: TensorDecision, shape: tuple[int, ...]) -> None:
    """Dispatch rule 9 for one tensor: K must be a multiple of the format's block along K.

    Args:
        decision: the tensor's decision.
        shape: its shape.

    Returns:
        None. Raises NonDivisibleTensors naming the tensor and the ignore entry that excludes it.
    """
    fmt = decision.format
    if not fmt.is_quantized or shape[-1] % fmt.k_multiple == 0:
        return
    module = naming.module_name(decision.name)
    pattern = misaligned_pattern(module)
    raise NonDivisibleTensors(
        f"tensor {decision.name!r} has K={shape[-1]}, not a multiple of {fmt.k_multiple} "
        f"({fmt.name} blocks along K); keep it in BF16 with rollout.quantization.ignore: {naming.yaml_list([pattern])}",
        tensors=(decision.name,),
        patterns=(pattern,),
    )


def _quantize(plan: QuantizationPlan, fmt: PrecisionFormat, w: Tensor, name: str, global_scale: Tensor | None) -> dict[str, Tensor]:
    from domain.quant.codecs import quantize_weight  # bounds its own scratch memory (row chunks)

    return quantize_weight(fmt, w, name=name, global_scale=global_scale, scale_rule=plan.scale_rule).tensors


def _emit(plan: QuantizationPlan, module: str, weight: Tensor, fmt, global_scale=None) -> Iterator[tuple[str, Tensor]]:
    tensors = _quantize(plan, fmt, weight, f"{module}.weight", global_scale)
    for local, tensor in tensors.items():
        yield f"{module}.{_local(plan, local)}", tensor


def _emit_fused_experts(plan: QuantizationPlan, d: TensorDecision, w: Tensor) -> Iterator[tuple[str, Tensor]]:
    from domain.quant.codecs import nvfp4_global_scale

    split = naming.expert_split(d.name, tuple(w.shape))
    gate_up = split[0][0].endswith("gate_proj")
    scales = None
    if d.format.has_global_scale and gate_up:
        # gate and up of one expert share one global scale: the amax over both halves.
        scales = nvfp4_global_scale(w, name=d.name)  # [E, 1]
    for module, e, rows in split:
        gs = scales[e] if scales is not None else None
        yield from _emit(plan, module, w[e, rows], d.format, gs)


class _Group:
    def __init__(self, name: str) -> None:
        self.name = name
        self.members = set(naming.group_members(name))
        self.items: list[tuple[TensorDecision, Tensor]] = []

    @property
    def complete(self) -> bool:
        return {naming.module_name(d.name) for d, _ in self.items} >= self.members


def _flush(plan: QuantizationPlan, group: _Group) -> Iterator[tuple[str, Tensor]]:
    from domain.quant.codecs import nvfp4_global_scale

    gs = nvfp4_global_scale(*(w for _, w in group.items), name=group.name)
    for d, w in group.items:
        yield from _emit(plan, naming.module_name(d.name), w, d.format, gs)


def quantize_stream(plan: QuantizationPlan, named_tensors: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """Quantize a model's weights into checkpoint-format tensors, one tensor at a time.

    Args:
        plan: the quantization plan.
        named_tensors: (Hugging Face name, tensor) pairs in layer order.

    Returns:
        An iterator of (checkpoint name, tensor) in the input's layer order: BF16 tensors pass
        through unchanged; quantized ones become `weight` / `weight_packed`, `weight_scale` (or
        `weight_scale_inv`) and, for NVFP4, `weight_global_scale`. A fused NVFP4 group (q/k/v,
        gate/up) is held until its last member arrives, then its members are emitted with one
        global scale computed over the whole group. A group still incomplete when the stream moves
        to another layer (e.g. a lone `q_proj` in MLA attention) is emitted with the members seen.
        A fused 3-D expert tensor is emitted as per-expert tensors (`experts.N.gate_proj...`).
        Raises NonDivisibleTensors (rule 9) and the codecs' InvalidTensor errors, naming the tensor.
    """
    pending: dict[str, _Group] = {}
    current_layer: object = object()
    for name, tensor in named_tensors:
        layer = naming.layer_index(name)
        if layer != current_layer:
            for g in list(pending):
                yield from _flush(plan, pending.pop(g))
            current_layer = layer
        d = plan.decide(name, tuple(tensor.shape))
        if not d.is_quantized:
            yield name, tensor
            continue
        check_divisible(d, tuple(tensor.shape))
        if d.group is not None:
            group = pending.setdefault(d.group, _Group(d.group))
            group.items.append((d, tensor))
            if group.complete:
                yield from _flush(plan, pending.pop(d.group))
        elif tensor.dim() == 3:
            yield from _emit_fused_experts(plan, d, tensor)
        else:
            yield from _emit(plan, naming.module_name(name), tensor, d.format)
    for g in list(pending):
        yield from _flush(plan, pending.pop(g))
