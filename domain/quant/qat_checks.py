"""The checks around quantization-aware training: QAT settings vs the rollout plan, effective precision.

- `check_qat_plan`: before QAT is applied, the QAT settings agree with the rollout plan
  (dispatch rules QatMatchesRollout, QatExcludesTeRecipe and FirstLastLayersBf16, reused from `domain.quant.dispatch` and `domain.quant.model_rules`);
- `check_effective_precision`: after it is applied, every linear and expert layer of the built
  model computes in the precision the rollout serves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import attrs

from domain.errors import FusedGroupSplit, QatPrecisionMismatch
from domain.keys import key
from domain.quant import dispatch, model_rules, naming
from domain.quant.plan import QuantizationPlan
from domain.quant.qat import HfPart, LayerPrecision, TrainerTensor, activation_scheme

Shapes = Sequence[tuple[str, tuple[int, ...]]]


# --- what each tensor should compute with ----------------------------------------------------


def _is_layer(part: HfPart) -> bool:
    """Linear or expert weights: dense/expert tensors and the default-ignored Linear layers."""
    cls = naming.classify(part.name, part.shape)
    if cls.kind != "passthrough":
        return True
    return len(part.shape) == 2 and "default ignore" in cls.reason


def tensor_precision(plan: QuantizationPlan, tensor: TrainerTensor) -> LayerPrecision:
    """What a trainer tensor must compute with under `plan`.

    Args:
        plan: the plan.
        tensor: the trainer tensor.

    Returns:
        Its LayerPrecision. Raises FusedGroupSplit when its parts get different formats or
        activation schemes (one input cannot be quantized two ways).
    """
    decisions = [plan.decide(p.name, p.shape) for p in tensor.parts]
    formats = sorted({d.format.name for d in decisions})
    schemes = sorted({activation_scheme(plan, d).value for d in decisions})
    if len(formats) > 1 or len(schemes) > 1:
        raise FusedGroupSplit(
            f"trainer tensor {tensor.name!r} holds {[p.name for p in tensor.parts]}, which the plan puts in "
            f"{formats} with activations {schemes}; keep all of them in BF16 with {key('quantization', 'ignore')} "
            "or none of them"
        )
    return LayerPrecision(tensor.name, formats[0], schemes[0])


def layer_tensors(tensors: Sequence[TrainerTensor]) -> tuple[TrainerTensor, ...]:
    """The trainer tensors that hold Linear or expert weights (what QAT may fake-quantize).

    Args:
        tensors: every trainer tensor of a model.

    Returns:
        Those with at least one Linear or expert part, in order.
    """
    return tuple(t for t in tensors if any(_is_layer(p) for p in t.parts))


def expected_precision(plan: QuantizationPlan, tensors: Sequence[TrainerTensor]) -> dict[str, LayerPrecision]:
    """The precision every linear and expert layer must train in: the rollout's.

    Args:
        plan: the rollout plan.
        tensors: the model's trainer tensors.

    Returns:
        trainer tensor name -> LayerPrecision, for every Linear or expert tensor.
    """
    return {t.name: tensor_precision(plan, t) for t in layer_tensors(tensors)}


def check_effective_precision(
    plan: QuantizationPlan, tensors: Sequence[TrainerTensor], actual: Mapping[str, LayerPrecision]
) -> None:
    """After QAT is applied: every linear and expert layer trains in the rollout's precision.

    Args:
        plan: the rollout plan.
        tensors: the model's trainer tensors.
        actual: what the QAT backend installed, by trainer tensor name (missing = BF16).

    Returns:
        None. Raises QatPrecisionMismatch listing every layer that differs, both ways (the
        rollout quantizes a layer that trains in BF16, or the trainer fake-quantizes a layer the
        rollout serves in BF16 or in another format).
    """
    expected = expected_precision(plan, tensors)
    names = list(expected) + [n for n, p in actual.items() if p.is_quantized and n not in expected]
    diffs = []
    for name in names:
        want = expected.get(name, LayerPrecision(name))
        got = actual.get(name, LayerPrecision(name))
        if (want.weight, want.activation) != (got.weight, got.activation):
            diffs.append((name, want.describe(), got.describe()))
    if diffs:
        listing = "; ".join(f"{n}: rollout {w}, training {g}" for n, w, g in diffs[:8])
        more = f" and {len(diffs) - 8} more" if len(diffs) > 8 else ""
        raise QatPrecisionMismatch(
            f"{len(diffs)} layer(s) would train in another precision than the rollout serves: {listing}{more}; "
            f"QAT must fake-quantize exactly the layers the rollout quantizes (check {key('quantization', 'ignore')}, "
            f"{key('qat', 'ignore_patterns')} and the backend's name mapping)",
            layers=tuple(diffs),
        )


# --- agreement of the QAT settings with the rollout plan --------------------------------------


def _names(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(items)


@attrs.frozen
class QatSettings:
    """actor.megatron.qat.* and the training settings QAT must agree with, as plain values.

    Attributes:
        mode: actor.megatron.qat.mode (a preset name).
        ignore: actor.megatron.qat.ignore_patterns.
        te_fp8, te_fp4: override_transformer_config.fp8 / fp4 (None = off).
        first_last_layers_bf16: override_transformer_config.first_last_layers_bf16.
        num_layers_at_start_in_bf16, num_layers_at_end_in_bf16: how many boundary layers.
    """

    mode: str | None
    ignore: tuple[str, ...] = attrs.field(default=(), converter=_names)
    te_fp8: object = None
    te_fp4: object = None
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1


def _num_layers(shapes: Shapes) -> int:
    layers = [i for n, _ in shapes if (i := naming.layer_index(n)) is not None]
    return max(layers) + 1 if layers else 0


def check_qat_plan(plan: QuantizationPlan, shapes: Shapes, settings: QatSettings,
                   num_layers: int | None = None) -> QuantizationPlan:
    """Check that QAT will train in the rollout's precision; return the plan QAT applies.

    Runs the dispatch rules (docs/plan.md#the-dispatch-rules) QatExcludesTeRecipe (no Transformer
    Engine FP8/FP4 recipe with QAT), QatMatchesRollout (qat.mode is the rollout's one preset; what
    qat.ignore_patterns keeps BF16 the rollout keeps BF16) and FirstLastLayersBf16 for QAT (layers
    `first_last_layers_bf16` keeps BF16 in training must be BF16 in the rollout; the error lists the
    layers that differ), from `domain.quant.dispatch` and `domain.quant.model_rules`.

    Args:
        plan: the resolved rollout plan.
        shapes: the model's (Hugging Face name, shape) pairs.
        settings: the QAT settings.
        num_layers: decoder layers (default: from the names).

    Returns:
        The QAT plan: the rollout plan plus the QAT ignore entries and the BF16 boundary layers.
        When the checks pass it decides every tensor as the rollout plan does.
    """
    dispatch.check_qat_te_recipe(qat_enable=True, te_fp8=settings.te_fp8, te_fp4=settings.te_fp4)
    dispatch.check_qat_mode(plan, qat_enable=True, qat_mode=settings.mode)
    model_rules.check_qat_ignore(plan, shapes, settings.ignore)
    bf16_layers = model_rules.bf16_training_layers(
        _num_layers(shapes) if num_layers is None else num_layers,
        enabled=settings.first_last_layers_bf16,
        at_start=settings.num_layers_at_start_in_bf16,
        at_end=settings.num_layers_at_end_in_bf16,
    )
    model_rules.check_boundary_layers(plan, shapes, bf16_layers)
    extra = list(settings.ignore)
    if bf16_layers:
        extra.append(model_rules.layer_ignore_entry(sorted(bf16_layers)))
    extra = [e for e in extra if e not in plan.ignore]
    return attrs.evolve(plan, ignore=plan.ignore + tuple(extra)) if extra else plan
