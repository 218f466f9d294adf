"""Quantization-aware training numerics: train on exactly the values the rollout decodes.

A trainer tensor (a Megatron `linear_qkv`, a Hugging Face `q_proj`, a fused 3-D expert tensor,
the reference model's fused `qkv`) holds one or more Hugging Face tensors, its `parts`. Its
fake-quantized value is computed by running those parts through the exporter itself
(`domain.quant.stream.quantize_stream`: same presets, same fused-group global scales, same per-expert
split) and decoding the checkpoint tensors (`dequantize_weight`), then writing the decoded parts
back into the trainer's layout. Gradients pass straight through (identity). Activations follow
the plan's per-token / dynamic scheme through the codec's `fake_quantize_activation`.

The checks a composition root runs around QAT are in `domain.quant.qat_checks`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from domain.errors import QatLayoutError
from domain.quant import naming
from domain.quant.codecs import QuantizedWeight, dequantize_weight, fake_quantize_activation
from domain.quant.formats import BF16, ActivationScheme
from domain.quant.plan import QuantizationPlan, TensorDecision
from domain.quant.stream import quantize_stream
from domain.quant.units import export_units

Tensor = torch.Tensor
Shapes = Sequence[tuple[str, tuple[int, ...]]]


def _ints(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


def _index(value: Iterable[object]) -> tuple[object, ...]:
    return tuple(value)


def _parts(value: Iterable[HfPart]) -> tuple[HfPart, ...]:
    return tuple(value)


@attrs.frozen(eq=False)
class HfPart:
    """One Hugging Face tensor inside a trainer tensor.

    Attributes:
        name: its Hugging Face name (`model.layers.0.self_attn.k_proj.weight`).
        shape: its shape.
        index: what selects it from the trainer tensor (`trainer[index]`): () for the whole
            tensor, a row slice, (expert, row slice), or a tensor of row numbers.
    """

    name: str
    shape: tuple[int, ...] = attrs.field(converter=_ints)
    index: tuple[object, ...] = attrs.field(default=(), converter=_index)

    def select(self, tensor: Tensor) -> Tensor:
        """This part of the trainer tensor (a view, or a copy for row lists)."""
        index: Any = self.index
        return tensor[index] if index else tensor


@attrs.frozen(eq=False)
class TrainerTensor:
    """A trainer parameter and the Hugging Face tensors it holds.

    Attributes:
        name: the trainer's parameter name (`decoder.layers.0.self_attention.linear_qkv.weight`).
        shape: the parameter's shape.
        parts: the Hugging Face tensors, in the exporter's (layer) order.
    """

    name: str
    shape: tuple[int, ...] = attrs.field(converter=_ints)
    parts: tuple[HfPart, ...] = attrs.field(converter=_parts)

    @property
    def module(self) -> str:
        return self.name.rpartition(".")[0]

    @property
    def param(self) -> str:
        return self.name.rpartition(".")[2]


@attrs.frozen
class LayerPrecision:
    """What one trainer tensor computes with.

    Attributes:
        name: the trainer tensor's name.
        weight: the weight preset ("BF16" when not fake-quantized; "A+B" when parts differ).
        activation: the input's ActivationScheme value ("none" when not fake-quantized).
    """

    name: str
    weight: str = "BF16"
    activation: str = ActivationScheme.NONE.value

    @property
    def is_quantized(self) -> bool:
        return self.weight != BF16.name or self.activation != ActivationScheme.NONE.value

    def describe(self) -> str:
        return f"weights {self.weight}, activations {self.activation}"


@attrs.frozen
class QatSummary:
    """What a QAT backend applied to a model.

    Attributes:
        backend: the backend's name ("reference", "modelopt").
        tensors: the model's tensors that hold Linear or expert weights, with their HF parts.
        precision: the effective precision of each of them, as the backend installed it.
    """

    backend: str
    tensors: tuple[TrainerTensor, ...]
    precision: tuple[LayerPrecision, ...]

    @property
    def quantized(self) -> tuple[LayerPrecision, ...]:
        return tuple(p for p in self.precision if p.is_quantized)

    def to_dict(self) -> dict[str, object]:
        return {
            "backend": self.backend,
            "layers": len(self.precision),
            "fake_quantized": len(self.quantized),
            "precision": {p.name: {"weight": p.weight, "activation": p.activation} for p in self.precision},
        }


# --- numerics ------------------------------------------------------------------------------


def _decode(plan: QuantizationPlan, d: TensorDecision, module: str, shape: tuple[int, ...],
            dtype: torch.dtype, out: Mapping[str, Tensor]) -> Tensor:
    tensors = {}
    for local in d.format.tensor_names:
        stored = plan.scale_name if local == "weight_scale" else local
        tensors[local] = out[f"{module}.{stored}"]
    return dequantize_weight(QuantizedWeight(d.format, tensors, shape, dtype), dtype)


@torch.no_grad()
def exported_values(plan: QuantizationPlan, named: Sequence[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """The values the rollout decodes for each tensor: dequantize(quantize_stream(plan, named)).

    Args:
        plan: the rollout quantization plan.
        named: (Hugging Face name, tensor) pairs in layer order; a fused group's members (q/k/v,
            gate/up) must all be given, as the exporter sees them.

    Returns:
        name -> tensor of the input's shape and dtype; tensors the plan keeps BF16 are returned
        unchanged. Raises the exporter's errors (NonDivisibleTensors, InvalidTensor) by name.
    """
    # The same codes under compressed-tensors' names (ModelOpt's layout renames them only).
    plan = attrs.evolve(plan, expert_layout="compressed-tensors")
    out = dict(quantize_stream(plan, named))
    values: dict[str, Tensor] = {}
    for name, t in named:
        shape = tuple(t.shape)
        d = plan.decide(name, shape)
        if not d.is_quantized:
            values[name] = t
        elif len(shape) == 3:
            full = torch.empty(shape, dtype=t.dtype, device=t.device)
            for module, e, rows in naming.expert_split(name, shape):
                full[e, rows] = _decode(plan, d, module, (rows.stop - rows.start, shape[-1]), t.dtype, out)
            values[name] = full
        else:
            values[name] = _decode(plan, d, naming.module_name(name), shape, t.dtype, out)
    return values


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: Tensor, fq: Tensor) -> Tensor:
        return fq.detach()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def straight_through(w: Tensor, fq: Tensor) -> Tensor:
    """`fq` in the forward (bit for bit), the identity for `w`'s gradient in the backward.

    Args:
        w: the trainable tensor.
        fq: its fake-quantized value (same shape and dtype).

    Returns:
        A tensor equal to `fq` whose gradient flows to `w` unchanged.
    """
    return _StraightThrough.apply(w, fq)


def check_parts(tensor: TrainerTensor) -> None:
    """Validate that the parts of a trainer tensor index into it with the shapes they claim.

    Args:
        tensor: the trainer tensor.

    Returns:
        None. Raises QatLayoutError naming the tensor and the part.
    """
    probe = torch.empty(tensor.shape, device="meta")
    for p in tensor.parts:
        try:
            got = tuple(p.select(probe).shape)
        except (IndexError, RuntimeError, TypeError) as err:
            raise QatLayoutError(f"trainer tensor {tensor.name!r}: part {p.name!r} does not index it ({err})") from None
        if got != p.shape:
            raise QatLayoutError(
                f"trainer tensor {tensor.name!r} {tensor.shape}: part {p.name!r} selects {got}, not {p.shape}; "
                "the name mapping does not match the model"
            )


def fake_quantize_tensors(plan: QuantizationPlan, items: Sequence[tuple[TrainerTensor, Tensor]]) -> list[Tensor]:
    """Weight fake-quantization of trainer tensors: the exporter's decoded values, with STE.

    Args:
        plan: the rollout quantization plan.
        items: (trainer tensor, its current value) pairs; together they must hold every member
            of any fused group one of them belongs to (e.g. HF q_proj, k_proj and v_proj).

    Returns:
        One tensor per item, in the item's dtype: parts the plan quantizes hold the decoded
        checkpoint values (bit-identical to dequantize(exported tensors)); other parts keep
        their values. Gradients flow to the inputs unchanged. Items the plan leaves entirely in
        BF16 are returned as given.
    """
    named = [(p.name, p.select(w.detach())) for tt, w in items for p in tt.parts]
    values = exported_values(plan, named)
    result = []
    for tt, w in items:
        quantized = [p for p in tt.parts if plan.decide(p.name, p.shape).is_quantized]
        if not quantized:
            result.append(w)
            continue
        if len(tt.parts) == 1 and not tt.parts[0].index:
            fq = values[tt.parts[0].name]
        else:
            with torch.no_grad():
                fq = w.detach().clone()
                for p in quantized:
                    index: Any = p.index
                    fq[index] = values[p.name]
        result.append(straight_through(w, fq))
    return result


def fused_units(plan: QuantizationPlan, tensors: Sequence[TrainerTensor]) -> dict[str, list[TrainerTensor]]:
    """Trainer tensors that must be fake-quantized together: their parts share an export unit.

    HF q_proj, k_proj and v_proj are three trainer tensors of one NVFP4 group; a Megatron
    linear_qkv is one trainer tensor holding the whole group. The units are the exporter's
    (`domain.quant.units.export_units` over every part, in model order).

    Args:
        plan: the plan (it decides the groups).
        tensors: the trainer tensors to fake-quantize, in model order.

    Returns:
        trainer tensor name -> its unit (the tensors to pass together to fake_quantize_tensors,
        in model order).
    """
    owner = list(range(len(tensors)))  # union-find over trainer tensors

    def root(i: int) -> int:
        while owner[i] != i:
            owner[i] = owner[owner[i]]
            i = owner[i]
        return i

    parts = ((p.name, p.shape, i) for i, t in enumerate(tensors) for p in t.parts)
    for unit in export_units(plan, parts):
        first, *rest = (root(i) for i in unit.values)
        for other in rest:
            owner[other] = first
    groups: dict[int, list[TrainerTensor]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(root(i), []).append(t)
    return {t.name: unit for unit in groups.values() for t in unit}


def activation_scheme(plan: QuantizationPlan, decision: TensorDecision) -> ActivationScheme:
    """The activation scheme the rollout applies to the input of a decided tensor.

    Args:
        plan: the plan.
        decision: the tensor's decision.

    Returns:
        NONE for BF16 tensors; the plan's expert scheme for experts, its dense scheme otherwise.
    """
    if not decision.is_quantized:
        return ActivationScheme.NONE
    return plan.effective_moe_activation if decision.kind == "expert" else plan.effective_linear_activation


def fake_quantize_input(
    plan: QuantizationPlan, scheme: ActivationScheme, x: Tensor, name: str = "activation"
) -> Tensor:
    """Activation fake-quantization as the rollout kernels do it (per token / dynamic), with STE.

    Args:
        plan: the rollout quantization plan (its element and MX scale rules).
        scheme: the activation scheme (NONE returns x).
        x: the layer input [..., K].
        name: the layer, for errors.

    Returns:
        The codec's quantize-dequantize of x (`domain.quant.codecs.fake_quantize_activation`).
    """
    return fake_quantize_activation(scheme, x, name=name, numerics=plan.numerics, scale_rule=plan.scale_rule)
