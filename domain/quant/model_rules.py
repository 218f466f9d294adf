"""Dispatch rules that need the model's tensor names and shapes (docs/plan.md#the-dispatch-rules):
QatMatchesRollout per tensor, FirstLastLayersBf16, BlockDivisibility and UniformFusedGroups. Pure functions over a plan and (name, shape) pairs; each raises a
typed error naming the tensors and the ignore entry that fixes it. Applied by domain.quant.dispatch.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from domain.errors import BoundaryLayersMismatch, FusedGroupSplit, NonDivisibleTensors, QatModeMismatch
from domain.keys import key
from domain.quant import naming
from domain.quant.plan import QuantizationPlan, TensorDecision

Shapes = Sequence[tuple[str, tuple[int, ...]]]


def check_qat_ignore(plan: QuantizationPlan, shapes: Shapes, qat_ignore: Sequence[str]) -> None:
    """QatMatchesRollout, per tensor: what QAT keeps in BF16 (ignore_patterns) the rollout must not
    quantize (docs/plan.md#qatmatchesrollout).

    Args:
        plan: the resolved plan.
        shapes: every tensor's (name, shape).
        qat_ignore: actor.megatron.qat.ignore_patterns.

    Returns:
        None. Raises QatModeMismatch listing the tensors and the ignore entries to add.
    """
    bad = [(n, e) for n, shape in shapes
           if (e := naming.first_match(qat_ignore, n)) is not None and plan.decide(n, shape).is_quantized]
    if bad:
        entries = sorted({e for _, e in bad})
        raise QatModeMismatch(
            f"{key('qat', 'ignore_patterns')} {entries} keep {len(bad)} tensor(s) in BF16 during training "
            f"(e.g. {bad[0][0]}) but the rollout quantizes them; add the same entries to "
            f"{key('quantization', 'ignore')}"
        )


def bf16_training_layers(num_layers: int, *, enabled: bool, at_start: int, at_end: int) -> set[int]:
    """The decoder layers that low-precision training keeps in BF16.

    Args:
        num_layers: number of decoder layers.
        enabled: override_transformer_config.first_last_layers_bf16.
        at_start, at_end: num_layers_at_start_in_bf16 / num_layers_at_end_in_bf16.

    Returns:
        The set of layer indices.
    """
    if not enabled:
        return set()
    return set(range(min(at_start, num_layers))) | set(range(max(num_layers - at_end, 0), num_layers))


def check_boundary_layers(plan: QuantizationPlan, shapes: Shapes, training_bf16: set[int]) -> None:
    """FirstLastLayersBf16: layers that NVFP4 training keeps BF16 must be BF16 in the rollout too
    (docs/plan.md#firstlastlayersbf16).

    Args:
        plan: the resolved plan.
        shapes: every tensor's (name, shape).
        training_bf16: layer indices training keeps BF16 (bf16_training_layers).

    Returns:
        None. Raises BoundaryLayersMismatch listing the layers and the ignore entry to add.
    """
    if not training_bf16 or not plan.is_quantized:
        return
    quantized = sorted({
        layer for name, shape in shapes
        if (layer := naming.layer_index(name)) in training_bf16 and plan.decide(name, shape).is_quantized
    })
    if quantized:
        entry = layer_ignore_entry(sorted(training_bf16))
        raise BoundaryLayersMismatch(
            f"training keeps layers {sorted(training_bf16)} in BF16 (first_last_layers_bf16) but the rollout "
            f"quantizes layers {quantized}; add {entry!r} to {key('quantization', 'ignore')}, or turn "
            "first_last_layers_bf16 off"
        )


def check_fused_groups(plan: QuantizationPlan, shapes: Shapes) -> None:
    """UniformFusedGroups: members of a fused module (q/k/v, gate/up) must all be quantized or all
    stay BF16 (docs/plan.md#uniformfusedgroups).

    Args:
        plan: the resolved plan.
        shapes: every tensor's (name, shape).

    Returns:
        None. Raises FusedGroupSplit naming the group and the ignored members.
    """
    seen: dict[str, dict[str, bool]] = {}
    for name, shape in shapes:
        cls = naming.classify(name, tuple(shape))
        if cls.group is not None:
            seen.setdefault(cls.group, {})[cls.module] = plan.decide(name, shape).is_quantized
    for group, members in seen.items():
        if len(set(members.values())) > 1:
            kept = sorted(m for m, q in members.items() if not q)
            raise FusedGroupSplit(
                f"{key('quantization', 'ignore')} keeps {kept} in BF16 but not the rest of fused group {group!r} "
                f"({sorted(members)}); engines load these as one layer: ignore all of them or none"
            )


def misaligned_pattern(module: str) -> str:
    """The ignore entry that keeps every module of this projection type in BF16 (rule-9 hint).

    Args:
        module: the module name, e.g. `model.layers.3.linear_attn.in_proj_ba`.

    Returns:
        A `re:` entry matching the projection's name in every layer, e.g. `re:.*\\.in_proj_ba$`.
    """
    return f"re:.*\\.{module.rsplit('.', 1)[-1]}$"


def check_divisible(decision: TensorDecision, shape: tuple[int, ...]) -> None:
    """BlockDivisibility for one tensor: K must be a multiple of the format's block along K
    (docs/plan.md#blockdivisibility).

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
        f"({fmt.name} blocks along K); keep it in BF16 with {key('quantization', 'ignore')}: {naming.yaml_list([pattern])}",
        tensors=(decision.name,),
        patterns=(pattern,),
    )


def check_block_divisible(plan: QuantizationPlan, shapes: Shapes) -> None:
    """BlockDivisibility: every quantized tensor's K must be a multiple of its format's block along
    K (docs/plan.md#blockdivisibility).

    Args:
        plan: the resolved plan.
        shapes: every tensor's (name, shape).

    Returns:
        None. Raises NonDivisibleTensors listing the tensors and the ignore entries excluding them.
    """
    bad: list[tuple[str, int, int]] = []
    for name, shape in shapes:
        d = plan.decide(name, tuple(shape))
        if d.is_quantized and shape[-1] % d.format.k_multiple:
            bad.append((name, shape[-1], d.format.k_multiple))
    if bad:
        tensors = tuple(n for n, _, _ in bad)
        patterns = _divisibility_fix(plan, shapes, tensors)
        listing = "; ".join(f"{n} (K={k}, block {b})" for n, k, b in bad[:8])
        more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
        raise NonDivisibleTensors(
            f"{len(bad)} tensor(s) cannot be quantized because K is not a multiple of the block: {listing}{more}; "
            f"keep them in BF16 with {key('quantization', 'ignore')}: {naming.yaml_list(patterns)}",
            tensors=tensors,
            patterns=patterns,
        )


def _divisibility_fix(plan: QuantizationPlan, shapes: Shapes, tensors: Sequence[str]) -> tuple[str, ...]:
    """Ignore entries that keep the misaligned tensors in BF16 and that the fused-group rule
    then accepts: an entry that catches one member of a q/k/v or gate/up group in some layer is
    joined by entries for the group's other members."""
    patterns = list(dict.fromkeys(misaligned_pattern(naming.module_name(n)) for n in tensors))
    for _ in range(len(naming.QKV_MEMBERS) + 1):  # each round adds the members of split groups
        trial = attrs.evolve(plan, ignore=(*plan.ignore, *patterns))
        groups: dict[str, dict[str, bool]] = {}
        for name, shape in shapes:
            cls = naming.classify(name, tuple(shape))
            if cls.group is not None:
                groups.setdefault(cls.group, {})[cls.module] = trial.decide(name, tuple(shape)).is_quantized
        split = [m for members in groups.values() if len(set(members.values())) > 1 for m, q in members.items() if q]
        if not split:
            break
        patterns += [p for p in dict.fromkeys(misaligned_pattern(m) for m in split) if p not in patterns]
    return tuple(patterns)


def layer_ignore_entry(layers: Sequence[int]) -> str:
    """An ignore entry keeping whole decoder layers in BF16.

    Args:
        layers: layer indices.

    Returns:
        `re:.*layers\\.(0|47)\\..*`
    """
    return "re:.*layers\\.(" + "|".join(str(i) for i in layers) + ")\\..*"

