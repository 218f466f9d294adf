"""LoRA errors: an adapter whose tensors do not fit its configuration or the model it targets.

Each names the module and says what to do.
"""

from __future__ import annotations

from domain.errors.base import RefitError


class LoraError(RefitError, ValueError):
    """An adapter cannot be used as given. Carries the module's name."""

    def __init__(self, module: str, problem: str, fix: str = "") -> None:
        self.module = module
        self.problem = problem
        self.fix = fix
        text = f"LoRA module {module!r}: {problem}"
        super().__init__(f"{text}; {fix}" if fix else text)


class LoraShapeMismatch(LoraError):
    """lora_A / lora_B do not fit each other or the base weight they modify ([r, K], [N, r])."""


class LoraRankMismatch(LoraError):
    """A module's rank differs from the adapter's `r`."""


class LoraNonFinite(LoraError):
    """lora_A or lora_B holds NaN or Inf values."""


class LoraUnknownTarget(LoraError):
    """A module is not one of the adapter's target modules, or not in the model."""


class LoraUnsupported(LoraError, NotImplementedError):
    """A PEFT feature the refit does not carry (DoRA, lora_bias, fan_in_fan_out, per-module ranks)."""


class AdapterUpdateFailed(RefitError, RuntimeError):
    """An adapter update did not go live: a worker could not build or hold the new adapter, or the
    base refit of the same step failed. The previous adapter still serves (or, when the base refit
    left the engine stale, nothing serves until a refit succeeds).

    Attributes:
        previous: the adapter id that still serves, or None.
    """

    def __init__(self, problem: str, previous: int | None) -> None:
        self.previous = previous
        still = f"adapter {previous} still serves" if previous is not None else "no adapter was serving"
        super().__init__(f"adapter update failed ({problem}); {still}; retry the update")
