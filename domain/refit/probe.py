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

import attrs
import torch

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


@attrs.frozen
class ProbeCheck:
    """One probe's result.

    Attributes:
        reference: what the engine was compared with, in words.
        bound: the max abs log-prob difference allowed.
        max_abs_diff: the largest difference seen (inf when shapes or finiteness differ).
        tokens: log-probs compared.
    """

    reference: str
    bound: float
    max_abs_diff: float
    tokens: int

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.bound

    @classmethod
    def compare(cls, engine: torch.Tensor, reference: torch.Tensor, *, bound: float, name: str) -> ProbeCheck:
        """Compare two [B, T-1] log-prob tensors (NaN or a shape mismatch counts as infinitely far)."""
        if engine.shape != reference.shape:
            return cls(name, bound, float("inf"), int(reference.numel()))
        e, r = engine.double(), reference.double()
        diff = (e - r).abs()
        same_inf = torch.isinf(e) & torch.isinf(r) & (torch.sign(e) == torch.sign(r))
        diff = torch.where(same_inf, torch.zeros_like(diff), diff)
        worst = float("inf") if bool(torch.isnan(diff).any()) else float(diff.max()) if diff.numel() else 0.0
        return cls(name, bound, worst, int(reference.numel()))

    def to_dict(self) -> dict[str, object]:
        return {"reference": self.reference, "bound": self.bound, "max_abs_diff": self.max_abs_diff,
                "tokens": self.tokens, "passed": self.passed}

    def __str__(self) -> str:
        if self.passed:
            return f"ok (max |dlogp| {self.max_abs_diff:.3g} <= {self.bound:g} vs {self.reference})"
        return f"FAILED (max |dlogp| {self.max_abs_diff:.3g} > {self.bound:g} vs {self.reference})"
