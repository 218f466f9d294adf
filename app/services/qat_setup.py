"""QAT at model build: resolve the rollout plan, check the QAT settings against it, apply, verify.

`prepare_qat` is what `app.bootstrap.Services.trainer_side.qat` runs once the trainer model exists:
1. the rollout plan, through the dispatch rules, on the model's own Hugging Face tensor names
   (`refit plan` decides the same way);
2. `domain.quant.qat_checks.check_qat_plan`: QAT mode vs rollout (QatMatchesRollout), no Transformer
   Engine FP8/FP4 recipe (QatExcludesTeRecipe), qat.ignore_patterns, and first/last BF16 layers vs
   the rollout ignore list (FirstLastLayersBf16);
3. the backend's `apply`;
4. the effective precision of every linear and expert layer against the rollout plan (QAT is
   removed again before the error is raised).
The returned QatSession is what the training loop keeps: `refresh()` after each optimizer step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import structlog
import torch

from adapters.profiles import resolve
from app.config_sections import RefitConfig
from app.services.planning import dispatch_input, with_numerics
from domain.quant.plan import QuantizationPlan
from domain.quant.qat import QatSummary
from domain.quant.qat_checks import QatSettings, check_effective_precision, check_qat_plan
from ports.qat_backend import QatBackend

log = structlog.get_logger()


@attrs.define
class QatSession:
    """QAT installed on one trainer model.

    Attributes:
        backend: the QatBackend that installed it.
        model: the trainer model.
        plan: the QAT plan (decides every tensor as the rollout plan does).
        rollout_plan: the resolved rollout plan.
        summary: what the backend installed, per layer.
    """

    backend: QatBackend
    model: torch.nn.Module
    plan: QuantizationPlan
    rollout_plan: QuantizationPlan
    summary: QatSummary

    def refresh(self) -> None:
        """Call after every optimizer step."""
        self.backend.refresh(self.model)

    def remove(self) -> None:
        """Take the fake-quantization out of the model."""
        self.backend.remove(self.model)


def qat_settings(cfg: RefitConfig) -> QatSettings:
    """actor.megatron.qat.* and the boundary-layer settings, as the domain's QatSettings."""
    qat = cfg.actor.megatron.qat
    te = cfg.actor.megatron.override_transformer_config
    return QatSettings(
        mode=qat.mode, ignore=qat.ignore_patterns, te_fp8=te.fp8, te_fp4=te.fp4,
        first_last_layers_bf16=te.first_last_layers_bf16,
        num_layers_at_start_in_bf16=te.num_layers_at_start_in_bf16,
        num_layers_at_end_in_bf16=te.num_layers_at_end_in_bf16,
    )


def rollout_plan_for(cfg: RefitConfig, shapes: list[tuple[str, tuple[int, ...]]],
                     model_config: Mapping[str, Any] | None = None) -> QuantizationPlan:
    """The rollout plan the dispatch rules resolve for this configuration and model.

    The same resolution as `app.services.planning.make_plan` (which also builds the engine's
    quantization_config, importing compressed-tensors; QAT needs only the plan).

    Args:
        cfg: the validated configuration.
        shapes: the model's (Hugging Face name, shape) pairs.
        model_config: the checkpoint's config.json, or None.

    Returns:
        The plan, with rollout.quantization.numerics and scale_rule applied.
    """
    return with_numerics(resolve(dispatch_input(cfg, model_config), shapes).plan, cfg)


def prepare_qat(cfg: RefitConfig, model: torch.nn.Module, backend: QatBackend,
                shapes: Sequence[tuple[str, tuple[int, ...]]], *,
                model_config: Mapping[str, Any] | None = None) -> QatSession | None:
    """Check and apply QAT for a configuration (see the module docstring).

    Args:
        cfg: the validated configuration.
        model: the trainer model, built.
        backend: the QatBackend to apply.
        shapes: the model's tensors under their Hugging Face names, in model order (what the
            exporter would stream; the composition root reads them off the model).
        model_config: the checkpoint's config.json (its quantization_config counts), or None.

    Returns:
        The QatSession, or None when actor.megatron.qat.enable is false. Raises the checks'
        typed errors (QatModeMismatch, QatWithTeRecipe, BoundaryLayersMismatch,
        QatPrecisionMismatch, ...).
    """
    if not cfg.actor.megatron.qat.enable:
        return None
    shapes = list(shapes)
    rollout_plan = rollout_plan_for(cfg, shapes, model_config)
    plan = check_qat_plan(rollout_plan, shapes, qat_settings(cfg))
    summary = backend.apply(model, plan)
    try:
        check_effective_precision(rollout_plan, summary.tensors, backend.effective_precision(model))
    except Exception:
        backend.remove(model)
        raise
    log.info("qat ready", backend=summary.backend, mode=cfg.actor.megatron.qat.mode,
             fake_quantized=len(summary.quantized), layers=len(summary.precision))
    return QatSession(backend, model, plan, rollout_plan, summary)

