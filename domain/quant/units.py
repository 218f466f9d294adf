"""The units of an export, in the order the exporter emits them: the one place that order lives.

A unit is either one tensor, or a fused group whose members share one NVFP4 global scale (q/k/v,
gate/up). Walking a model's tensors in layer order, a tensor the plan does not group is its own
unit where it stands; a group's members are held until its last member arrives, and the group is
emitted then; a group still incomplete when the walk moves to another layer (e.g. a lone `q_proj`
in MLA attention) is emitted with the members seen. The single-process export, the sharded
export's placement of units on ranks, and QAT's grouping of trainer tensors all walk this one
iterator, so they cannot disagree on the order or the grouping.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

import attrs

from domain.quant import naming
from domain.quant.model_rules import check_divisible
from domain.quant.plan import QuantizationPlan, TensorDecision

T = TypeVar("T")


@attrs.frozen
class Unit(Generic[T]):
    """Tensors exported together.

    Attributes:
        items: (decision, the caller's item) per member, in walk order.
        group: the fused group's name, or None for a unit of one tensor.
    """

    items: tuple[tuple[TensorDecision, T], ...]
    group: str | None = None

    @property
    def decisions(self) -> tuple[TensorDecision, ...]:
        return tuple(d for d, _ in self.items)

    @property
    def values(self) -> tuple[T, ...]:
        return tuple(v for _, v in self.items)


def export_units(plan: QuantizationPlan, items: Iterable[tuple[str, tuple[int, ...], T]]) -> Iterator[Unit[T]]:
    """Group a model's tensors into export units, in the exporter's order.

    Args:
        plan: the quantization plan (it decides each tensor and its group).
        items: (Hugging Face name, shape, anything the caller wants back) per tensor, in layer
            order; the iterator is lazy, so a streaming caller holds at most the pending groups.

    Returns:
        The units. Every quantized tensor is checked against dispatch rule BlockDivisibility first
        (NonDivisibleTensors naming it and the ignore entry that excludes it).
    """
    pending: dict[str, list[tuple[TensorDecision, T]]] = {}
    current_layer: object = object()
    for name, shape, value in items:
        layer = naming.layer_index(name)
        if layer != current_layer:
            for group in list(pending):
                yield Unit(tuple(pending.pop(group)), group)
            current_layer = layer
        d = plan.decide(name, tuple(shape))
        if d.is_quantized:
            check_divisible(d, tuple(shape))
        if not d.is_quantized or d.group is None:
            yield Unit(((d, value),))
            del value  # not alive while the next tensor is read
            continue
        members = pending.setdefault(d.group, [])
        members.append((d, value))
        del value
        if {naming.module_name(m.name) for m, _ in members} >= set(naming.group_members(d.group)):
            del members
            yield Unit(tuple(pending.pop(d.group)), d.group)
    for group in list(pending):
        yield Unit(tuple(pending.pop(group)), group)
