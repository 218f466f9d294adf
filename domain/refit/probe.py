"""The post-refit probe: does the engine serve the weights the trainer sent?

A refit can report success and still serve other weights (an engine step that silently did not
run, a kernel layout written in the wrong byte order). The storage check cannot see it: the
pointers are right, the bytes are not. The probe compares the engine's log-probs on a small fixed
token batch with a reference's, after the refit committed, and fails closed when they differ by
more than the plan's bound.

The bound depends on how the reference is computed:

| reference | bound (max abs log-prob difference) |
|---|---|
| computed the engine's way (the same engine, started cold from the exported checkpoint; or an engine whose forward is the trainer's own) | exactly 0, every format |
| the trainer's BF16 forward | the plan's per-format bound (`TRAINER_BOUNDS`, its widest format) |

The per-format bounds hold the rounding of a low-precision forward against BF16 on the probe's
few tokens with room to spare; a corrupted refit (a zeroed or scaled tensor, a wrong layout)
moves log-probs by far more.
"""

from __future__ import annotations

from domain.quant.plan import QuantizationPlan

# Max abs log-prob difference allowed between an engine and the trainer's BF16 forward, per
# format the plan uses (the widest applies). BF16 covers kernel rounding (fused GEMMs,
# attention kernels, reduced-precision softmax); the others add their quantization error.
TRAINER_BOUNDS: dict[str, float] = {
    "BF16": 0.05,
    "FP8_BLOCK": 0.25,
    "MXFP8": 0.25,
    "NVFP4": 1.0,
    "MXFP4": 1.5,
}


def probe_bound(plan: QuantizationPlan, *, engine_way: bool) -> float:
    """The bound a probe holds the engine to.

    Args:
        plan: the refit's plan.
        engine_way: the reference is computed the engine's way (then exactly 0).

    Returns:
        The max abs log-prob difference allowed.
    """
    if engine_way:
        return 0.0
    return max(TRAINER_BOUNDS[f.name] for f in (plan.linear, plan.moe))
