"""Errors of the trainer's forward: the fused log-prob/entropy, THD packing, packed GDN, Megatron models."""

from __future__ import annotations

from domain.errors.base import RefitError
from domain.errors.config import ConfigError, UnsupportedCombination


class InvalidPackedBoundaries(RefitError, ValueError):
    """Packed-sequence boundaries (`cu_seqlens_q` / `cu_seqlens_q_padded`) are malformed.

    Carries the name of the boundary tensor that failed.
    """

    def __init__(self, name: str, problem: str, fix: str = "") -> None:
        self.name = name
        self.problem = problem
        self.fix = fix
        text = f"packed_seq_params.{name}: {problem}"
        super().__init__(f"{text}; {fix}" if fix else text)


class PackedGdnDeterministic(UnsupportedCombination):
    """Packed (THD) input reached a GDN layer while `deterministic_mode` is on."""


class PackedGdnUnsupported(RefitError, NotImplementedError):
    """Packed input reached a GDN layer in a setting the packed-aware forward cannot run."""


class InvalidTemperature(RefitError, ValueError):
    """The sampling temperature is not a finite number above zero."""


class FusedForwardModeError(ConfigError):
    """`actor.fused_forward` (or `VERL_FUSED_USE_OP_HOOK`) holds a value that is not a mode."""


class FusedHookUnavailable(RefitError, RuntimeError):
    """The native `output_processor` hook was required but the model's forward lacks it."""


class FusedForwardUnsupported(RefitError, NotImplementedError):
    """The model uses a feature the fused forward does not handle (named in the message)."""


class MegatronModelUnsupported(RefitError, NotImplementedError):
    """The Megatron model has a layout the adapter cannot name or gather (named in the message)."""


class ThdPackingError(RefitError, ValueError):
    """Sequence lengths or a THD layout cannot be packed or unpacked as asked."""
