"""Quantization-aware training errors (domain.quant.qat, adapters/qat_reference, adapters/modelopt)."""

from __future__ import annotations

from domain.errors.base import RefitError


class QatPrecisionMismatch(RefitError, ValueError):
    """After QAT is applied, layers train in another precision than the rollout serves.

    Carries `layers`: (layer, what the plan says, what the model does) for every difference.
    """

    def __init__(self, message: str, layers: tuple[tuple[str, str, str], ...] = ()) -> None:
        self.layers = layers
        super().__init__(message)


class QatNumericsMismatch(RefitError, RuntimeError):
    """A QAT backend's weight fake-quantization is not bit-identical to the exporter's. Names the layer."""

    def __init__(self, layer: str, message: str) -> None:
        self.layer = layer
        super().__init__(f"layer {layer!r}: {message}")


class QatLayoutError(RefitError, ValueError):
    """A trainer tensor cannot be split into the Hugging Face tensors the exporter quantizes."""


class QatStateError(RefitError, RuntimeError):
    """A QAT backend was asked to refresh or remove before apply, or to apply twice."""


class QatUnsupportedModel(RefitError, NotImplementedError):
    """The model has a setting under which QAT cannot reproduce the exporter's bits (named in the message)."""
