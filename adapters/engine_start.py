"""What a real engine starts with for one plan: the composition root resolves it, the engine's
factory (adapters/<engine>/factory.py) turns it into the engine's own arguments."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from domain.errors import ConfigError
from domain.quant.backend_policy import BackendDecision
from domain.quant.plan import QuantizationPlan
from domain.refit.session import CommitMode


@attrs.frozen
class EngineStart:
    """One engine start, for the plan the refits into it will send.

    Attributes:
        plan: the plan the engine is configured for (the refits' plan, whatever the
            configuration's is).
        quantization_config: the engine's quantization_config for that plan (None: BF16).
        layout: the resolution's checkpoint layout ("bf16", "compressed-tensors", "sglang-mxfp8", ...).
        decision: the backend policy's decision for the engine and that plan.
        model_path: model.path, the checkpoint the engine starts from (None: the embedded model).
    """

    plan: QuantizationPlan
    quantization_config: Mapping[str, Any] | None
    layout: str
    decision: BackendDecision
    model_path: str | None = None


def check_commit_mode(asked: CommitMode | None, engine_mode: CommitMode, engine: str) -> None:
    """ConfigError naming rollout.commit_mode when an engine is asked for a mode it lacks."""
    if asked is not None and asked is not engine_mode:
        raise ConfigError("rollout.commit_mode", f"{engine} commits {engine_mode.value} only; leave it unset or "
                          f"set {engine_mode.value}")


def same_model(served: str, wanted: str) -> bool:
    """Whether a server that says it serves `served` serves the model at `wanted` (model.path):
    the same string, or paths to the same directory."""
    from pathlib import Path

    if served == wanted:
        return True
    try:
        return Path(served).resolve() == Path(wanted).resolve()
    except OSError:
        return False

