"""The error hierarchy. One base class; each error also subclasses the matching builtin.

Messages name the tensor or configuration key and say what to do instead.
"""

from __future__ import annotations


class RefitError(Exception):
    """Base class of every error rl-refit raises on purpose."""


# --- tensors handed to a codec -------------------------------------------------------------


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


# --- configuration and dispatch ------------------------------------------------------------


class ConfigError(RefitError, ValueError):
    """A configuration key is unknown or has a wrong value. Carries the key."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


class UnsupportedCombination(RefitError, ValueError):
    """Two or more settings cannot work together. Names the keys and what to use instead."""


class UnsupportedQuantMethod(RefitError, NotImplementedError):
    """A quantization method exists but the trainer cannot produce it."""


# --- refit lifecycle -----------------------------------------------------------------------


class RefitLifecycleError(RefitError, RuntimeError):
    """A refit step arrived in a state that does not accept it."""


class BucketSequenceError(RefitLifecycleError):
    """A bucket arrived out of order, twice, or the sequence ended early."""


class StorageRebound(RefitError, RuntimeError):
    """A tensor captured by CUDA graphs changed data pointer, shape, stride or dtype."""


class EngineStale(RefitError, RuntimeError):
    """The engine's weights are not a complete refit; it refuses to serve."""


class RefitFailed(RefitError, RuntimeError):
    """A refit failed; the message says what state the engine was left in."""
