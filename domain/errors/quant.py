"""Quantization errors: tensors a codec cannot take, methods the trainer cannot produce, the dispatch
rules (domain.quant.dispatch, rules, model_rules) and the backend policy."""

from __future__ import annotations

from domain.errors.base import RefitError
from domain.errors.config import UnsupportedCombination


class InvalidTensor(RefitError, ValueError):
    """A tensor cannot be quantized as asked. Carries the tensor's name."""

    def __init__(self, tensor: str, problem: str, fix: str = "") -> None:
        self.tensor = tensor
        self.problem = problem
        self.fix = fix
        text = f"tensor {tensor!r}: {problem}"
        super().__init__(f"{text}; {fix}" if fix else text)


class NonFiniteTensor(InvalidTensor):
    """The tensor holds NaN or Inf values."""


class BlockMisaligned(InvalidTensor):
    """The quantized dimension is not a multiple of the format's block."""


class UnsupportedShape(InvalidTensor):
    """The tensor's rank is not one the format quantizes."""


class UnsupportedDtype(InvalidTensor, TypeError):
    """The tensor's dtype is not a floating type the codecs accept."""


class UnsupportedQuantMethod(RefitError, NotImplementedError):
    """A quantization method exists but the trainer cannot produce it."""


class NativeRefitUnsupported(UnsupportedQuantMethod):
    """Dispatch rule UnexportableNativeMethod for refits (docs/plan.md#unexportablenativemethod): the engine would serve a native layout (e.g. GPT-OSS mxfp4) the
    trainer cannot produce, so a refit would send tensors that layout cannot load."""


class ConfigNotHonoured(UnsupportedCombination):
    """A user's compressed-tensors quantization_config has fields the trainer's export cannot honour
    as written. Carries `differences`, one sentence per field."""

    def __init__(self, message: str, differences: tuple[str, ...] = ()) -> None:
        self.differences = differences
        super().__init__(message)


class QatModeMismatch(UnsupportedCombination):
    """Dispatch rule QatMatchesRollout (docs/plan.md#qatmatchesrollout): the QAT mode does not match the
    rollout quantization."""


class NativeLayoutOverride(UnsupportedCombination):
    """Dispatch rule NativeReleaseLayout (docs/plan.md#nativereleaselayout): a model whose exporter emits
    the release layout got an override."""


class QuantizedDeltaSync(UnsupportedCombination):
    """Dispatch rule QuantizedFullSync (docs/plan.md#quantizedfullsync): a quantized rollout with a
    delta/sharded sync backend or wire format."""


class QatWithTeRecipe(UnsupportedCombination):
    """Dispatch rule QatExcludesTeRecipe (docs/plan.md#qatexcludesterecipe): QAT together with a
    Transformer Engine FP8/FP4 training recipe."""


class EngineRejectsQuantization(UnsupportedCombination):
    """Dispatch rules EngineSupportMatrix and an engine's own (TrtllmBf16Only): the rollout engine
    cannot serve this quantization (docs/plan.md#enginesupportmatrix)."""


class EngineCellUnsupported(EngineRejectsQuantization):
    """Dispatch rule EngineSupportMatrix (docs/plan.md#enginesupportmatrix): one (engine, layout, role, format, activations) cell of the support matrix
    that the pinned engine does not load and run as exported. Carries the cell and the engine's
    reason with its code location."""

    def __init__(self, message: str, *, engine: str, layout: str, role: str, fmt: str, activation: str,
                 reason: str, where: str, instead: str) -> None:
        self.engine = engine
        self.layout = layout
        self.role = role
        self.fmt = fmt
        self.activation = activation
        self.reason = reason
        self.where = where
        self.instead = instead
        super().__init__(message)


class BoundaryLayersMismatch(UnsupportedCombination):
    """Dispatch rule FirstLastLayersBf16 (docs/plan.md#firstlastlayersbf16): NVFP4 training keeps
    first/last layers BF16 but the rollout does not."""


class FusedGroupSplit(UnsupportedCombination):
    """Dispatch rule UniformFusedGroups (docs/plan.md#uniformfusedgroups): an ignore entry keeps only
    part of a fused group (q/k/v, gate/up) in BF16."""


class NonDivisibleTensors(RefitError, ValueError):
    """Dispatch rule BlockDivisibility (docs/plan.md#blockdivisibility): tensors whose K is not a
    multiple of the format's block."""

    def __init__(self, message: str, tensors: tuple[str, ...] = (), patterns: tuple[str, ...] = ()) -> None:
        self.tensors = tensors
        self.patterns = patterns
        super().__init__(message)


class GpuCapabilityTooLow(UnsupportedCombination):
    """The GPU has no kernels for a preset the rollout plan uses (FP8 block: SM90+; MX, NVFP4: SM100+)."""
