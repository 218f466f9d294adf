"""The dispatch rules on single settings (docs/plan.md#the-dispatch-rules: QatMatchesRollout,
QuantizedFullSync, QatExcludesTeRecipe and DynamicActivationsOnly): pure functions of plain values,
each raising a typed error that names the key. domain.quant.dispatch applies them to every
resolution; EngineSupportMatrix, an engine's support table, is domain.quant.support; the rules only
some engines have come with their adapter's profile.
"""

from __future__ import annotations

from domain.errors import (
    QatModeMismatch,
    QatWithTeRecipe,
    QuantizedDeltaSync,
    UnsupportedCombination,
)
from domain.keys import key
from domain.quant.formats import ActivationScheme
from domain.quant.plan import QuantizationPlan
from domain.quant.qat_modes import QAT_MODES, parse_qat_mode

DELTA_BACKENDS = ("delta_sharded",)
# Our own delta backend sends deltas of the rollout's checkpoint layout, patched into whole tensors
# before the engine's normal reload (domain.refit.delta_sync): QuantizedFullSync accepts it for every format.
LAYOUT_DELTA_BACKEND = "layout_delta"
DELTA_WIRE_FORMATS = ("delta_flush",)


def _role_pairs(plan: QuantizationPlan) -> list[tuple[str, str, ActivationScheme]]:
    pairs = [("linear", plan.linear.name, plan.effective_linear_activation),
             ("moe", plan.moe.name, plan.effective_moe_activation)]
    return [(role, fmt, act) for role, fmt, act in pairs if fmt != "BF16"]


def check_qat_mode(plan: QuantizationPlan | None, *, qat_enable: bool, qat_mode: str | None) -> None:
    """QatMatchesRollout: QAT fake-quantizes to the weights and activations the rollout serves
    (docs/plan.md#qatmatchesrollout).

    Args:
        plan: what the rollout serves (None: a native layout no preset describes).
        qat_enable: actor.megatron.qat.enable.
        qat_mode: actor.megatron.qat.mode (a verl mode name or a preset name, domain.quant.qat_modes).

    Returns:
        None. Raises QatModeMismatch naming both settings and the reason.
    """
    if not qat_enable:
        return
    mode = parse_qat_mode(qat_mode)
    if plan is None:
        raise QatModeMismatch(
            f"{key('qat', 'mode')}={qat_mode!r}: the rollout serves the checkpoint's native layout, which no QAT "
            f"mode reproduces; disable QAT or serve a preset ({key('quantization', 'linear')} / moe)"
        )
    pairs = _role_pairs(plan)
    formats = list(dict.fromkeys(fmt for _, fmt, _ in pairs))
    if mode is None or formats != [mode.format.name]:
        raise QatModeMismatch(
            f"{key('qat', 'mode')}={qat_mode!r} does not match the rollout quantization "
            f"({key('rollout', 'quantization')}: {', '.join(formats) or 'BF16'}); QAT must train in the one format "
            f"the rollout serves: set qat.mode to {_mode_for(*pairs[0][1:]) if len(formats) == 1 else 'that format'}, "
            f"or change {key('rollout', 'quantization')}, or disable QAT"
        )
    for role, fmt, act in pairs:
        if act is not mode.activation:
            fit = _mode_for(fmt, act)
            instead = f"set qat.mode={fit}" if fit else f"no QAT mode trains {fmt} with {act.value} activations"
            raise QatModeMismatch(
                f"{key('qat', 'mode')}={qat_mode!r} trains {mode.describe()}, but the rollout serves "
                f"{key('quantization', role)}={fmt} with {act.value} activations; {instead}, or set "
                f"{key('quantization', role + '_activation')}={mode.activation.value}"
            )


def _mode_for(fmt: str, act: ActivationScheme) -> str | None:
    return next((m.name for m in QAT_MODES.values() if m.format.name == fmt and m.activation is act), None)


def check_sync_backend(quantized: bool, *, backend: str | None, wire_format: str | None) -> None:
    """QuantizedFullSync: a quantized rollout needs the complete bucket sequence to finalize
    (docs/plan.md#quantizedfullsync).

    Args:
        quantized: whether the rollout is quantized.
        backend: rollout.checkpoint_engine.backend.
        wire_format: rollout.wire_format.

    Returns:
        None. Raises QuantizedDeltaSync naming the key and the rule.
    """
    if not quantized:
        return
    if backend in DELTA_BACKENDS:
        raise QuantizedDeltaSync(
            f"{key('checkpoint_engine', 'backend')}={backend!r} sends partial updates, but a quantized rollout "
            "post-processes once after the complete bucket sequence (dispatch rule QuantizedFullSync); use a "
            "full-sync backend "
            "(e.g. 'nccl')"
        )
    if wire_format in DELTA_WIRE_FORMATS:
        raise QuantizedDeltaSync(
            f"{key('rollout', 'wire_format')}={wire_format!r} flushes deltas, but a quantized rollout needs every bucket "
            "before finalizing (dispatch rule QuantizedFullSync); use the 'bucketed' wire format"
        )


def check_qat_te_recipe(*, qat_enable: bool, te_fp8: object, te_fp4: object) -> None:
    """QatExcludesTeRecipe: QAT and a Transformer Engine FP8/FP4 training recipe are mutually
    exclusive (docs/plan.md#qatexcludesterecipe).

    Args:
        qat_enable: actor.megatron.qat.enable.
        te_fp8: override_transformer_config.fp8 (None/False = off).
        te_fp4: override_transformer_config.fp4 (None/False = off).

    Returns:
        None. Raises QatWithTeRecipe naming the keys.
    """
    on = [k for k, v in (("fp8", te_fp8), ("fp4", te_fp4)) if v not in (None, False, "")]
    if qat_enable and on:
        keys = ", ".join(key("te", k) for k in on)
        raise QatWithTeRecipe(
            f"{key('qat', 'enable')} is true together with {keys}: QAT fake-quantizes BF16 weights and "
            "cannot run inside a Transformer Engine low-precision recipe; disable one of them"
        )


def check_static_activations(plan: QuantizationPlan) -> None:
    """DynamicActivationsOnly: static NVFP4 activations need calibrated input scales that a trainer
    cannot compute (docs/plan.md#dynamicactivationsonly).

    Args:
        plan: the resolved plan.

    Returns:
        None. Raises UnsupportedCombination naming the key.
    """
    for role, act in (("linear", plan.effective_linear_activation), ("moe", plan.effective_moe_activation)):
        if act is ActivationScheme.NVFP4_STATIC:
            raise UnsupportedCombination(
                f"{key('quantization', role)} uses static NVFP4 activations, which need a calibrated "
                "input_global_scale the trainer-side export cannot compute; use nvfp4_per_token "
                f"({key('quantization', role + '_activation')}) instead"
            )
