"""The support matrix (dispatch rule 6): what the pinned engines load and run, cell by cell.

A cell is one (engine, layout, role, preset, activations) combination that the trainer can
export. Each has a Verdict: shown (the engine code path that loads and runs the export is cited,
file:line in the pinned wheel, and where it runs, tested) or rejected (the engine's reason, where
in its code, and what to use instead). `check_cells` applies the verdicts to a plan; the tables
live in domain.quant.support_vllm and domain.quant.support_sglang, and docs/support-matrix.md is
checked against them (tests/unit/test_support_matrix.py).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from types import MappingProxyType

import attrs

from domain.environment import PINNED_ENGINES
from domain.errors import EngineCellUnsupported
from domain.quant.formats import FORMATS, FP8_BLOCK, MXFP8, ActivationScheme
from domain.quant.plan import ACTIVATIONS, QuantizationPlan

SUPPORT_ENGINES = ("vllm", "sglang")
ROLES = ("linear", "moe")
# The checkpoint layouts a trainer export reaches an engine in (dispatch.layout_for).
COMPRESSED_TENSORS = "compressed-tensors"
SGLANG_MXFP8 = "sglang-mxfp8"
NATIVE_FP8 = "native-fp8"
LAYOUTS = (COMPRESSED_TENSORS, SGLANG_MXFP8, NATIVE_FP8)

# How a verdict was reached.
READ = "read"  # the cited engine code, read in the pinned wheel
CPU_VLLM = "cpu"  # run on CPU against vLLM's own code (tests/vllm/test_support_matrix.py)
GPU_SCRIPT = "gpu-script"  # in the prepared GPU check (tests/gpu/check_support_matrix.py)
# served end to end by vLLM's CPU build, every refit equal to a cold start bit for bit
# (tests/vllm/test_real_engine.py), the matmul emulated where the CPU has no kernel for it
CPU_SERVED = "cpu-served"
HOW = (READ, CPU_VLLM, GPU_SCRIPT, CPU_SERVED)
_ROLE_KEY = {"linear": "rollout.quantization.linear", "moe": "rollout.quantization.moe"}


@attrs.frozen
class Cell:
    """One combination an engine is asked to serve.

    Attributes:
        engine: "vllm" or "sglang".
        layout: the checkpoint layout (LAYOUTS).
        role: "linear" (dense Linear layers) or "moe" (routed experts).
        fmt: the preset name (FP8_BLOCK, MXFP8, MXFP4, NVFP4).
        activation: the role's activation scheme.
    """

    engine: str = attrs.field(validator=attrs.validators.in_(SUPPORT_ENGINES))
    layout: str = attrs.field(validator=attrs.validators.in_(LAYOUTS))
    role: str = attrs.field(validator=attrs.validators.in_(ROLES))
    fmt: str = attrs.field(validator=attrs.validators.in_(tuple(FORMATS)))
    activation: ActivationScheme

    def describe(self) -> str:
        """`rollout.quantization.moe=NVFP4 with nvfp4_per_token activations`, as messages write it."""
        return f"{_ROLE_KEY[self.role]}={self.fmt} with {self.activation.value} activations"


def cite(engine: str, path: str, lines: str) -> str:
    """A code location in a pinned wheel: `vllm 0.33.0 vllm/model_executor/...py:796-797`.

    Args:
        engine: "vllm" or "sglang".
        path: the file inside the wheel (`vllm/...` or `sglang/...`).
        lines: a line or a range.

    Returns:
        The citation string.
    """
    return f"{engine} {PINNED_ENGINES[engine]} {path}:{lines}"


def _strs(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.frozen
class Verdict:
    """What the pinned engine does with one cell, and how that was established.

    Attributes:
        cell: the cell.
        shown: True when the engine loads and runs the export as the plan declares it.
        engine_path: the engine's scheme or method for it and what it allocates and computes, in words.
        where: the code locations (`cite`) the verdict rests on, first the decisive one.
        how: READ, plus CPU_VLLM / GPU_SCRIPT where a test runs it.
        reason: for a rejected cell, the engine's reason.
        instead: for a rejected cell, what to configure instead.
        note: for a shown cell, what depends on the GPU or kernel (empty when nothing does).
    """

    cell: Cell
    shown: bool
    engine_path: str
    where: tuple[str, ...] = attrs.field(converter=_strs)
    how: tuple[str, ...] = attrs.field(default=(READ,), converter=_strs)
    reason: str = ""
    instead: str = ""
    note: str = ""

    def __attrs_post_init__(self) -> None:
        if not self.where or any(h not in HOW for h in self.how) or READ not in self.how:
            raise ValueError(f"{self.cell}: a verdict needs its code locations and how it was shown")
        if not self.shown and not (self.reason and self.instead):
            raise ValueError(f"{self.cell}: a rejected cell needs the engine's reason and what to do instead")


def exportable_activations(fmt: str) -> tuple[ActivationScheme, ...]:
    """The activation schemes the trainer can export with a preset (static NVFP4 activations need
    calibrated scales and are rejected for every engine by rules.check_static_activations)."""
    return tuple(a for a in ACTIVATIONS[fmt] if a is not ActivationScheme.NVFP4_STATIC)


def layouts_for(engine: str, fmt: str) -> tuple[str, ...]:
    """The layouts a trainer export of `fmt` can reach `engine` in (see dispatch.layout_for)."""
    out = [COMPRESSED_TENSORS]
    if fmt == MXFP8.name:
        out.append(SGLANG_MXFP8)  # SGLang's own layout; a checkpoint's `quant_method: mxfp8` on vLLM
    if fmt == FP8_BLOCK.name:
        out.append(NATIVE_FP8)  # a checkpoint's DeepSeek-style `quant_method: fp8`
    return tuple(out)


def all_cells() -> list[Cell]:
    """Every cell `refit plan` could be asked for: the domain the verdict tables must cover."""
    cells = []
    for engine in SUPPORT_ENGINES:
        for fmt in (f for f in FORMATS if FORMATS[f].is_quantized):
            for layout in layouts_for(engine, fmt):
                acts = exportable_activations(fmt)
                if layout != COMPRESSED_TENSORS and not (engine == "sglang" and layout == SGLANG_MXFP8):
                    acts = (FORMATS[fmt].activation,)  # a native config names no other activations
                cells += [Cell(engine, layout, role, fmt, act) for role in ROLES for act in acts]
    return cells


def default_layout(engine: str, plan: QuantizationPlan) -> str:
    """The layout a plan from rollout.quantization reaches the engine in: SGLang serves a plan whose
    only preset is MXFP8 in its native `quant_method: mxfp8` layout, everything else is
    compressed-tensors."""
    if engine == "sglang" and [f.name for f in plan.formats] == [MXFP8.name]:
        return SGLANG_MXFP8
    return COMPRESSED_TENSORS


def plan_cells(engine: str, plan: QuantizationPlan, layout: str) -> list[Cell]:
    """The cells a plan asks `engine` for (its quantized roles), in role order."""
    pairs = (("linear", plan.linear, plan.effective_linear_activation),
             ("moe", plan.moe, plan.effective_moe_activation))
    return [Cell(engine, layout, role, fmt.name, act) for role, fmt, act in pairs if fmt.is_quantized]


@functools.cache
def verdicts() -> Mapping[Cell, Verdict]:
    """Every verdict of both engines, by cell (read-only)."""
    from domain.quant.support_sglang import SGLANG_VERDICTS
    from domain.quant.support_vllm import VLLM_VERDICTS

    return MappingProxyType({v.cell: v for v in (*VLLM_VERDICTS, *SGLANG_VERDICTS)})


def verdict(cell: Cell) -> Verdict:
    """The verdict of one cell; a cell the tables lack is a bug in them (KeyError)."""
    return verdicts()[cell]


def check_cells(engine: str, plan: QuantizationPlan, layout: str | None = None) -> list[Verdict]:
    """Rule 6: every cell of the plan must be shown for the engine.

    Args:
        engine: rollout.name; engines without a support table (reference, trtllm) pass.
        plan: what the engine serves.
        layout: the checkpoint layout (dispatch.layout_for); None = default_layout.

    Returns:
        The verdicts of the plan's cells. Raises EngineCellUnsupported for the first rejected cell,
        with the engine's reason, its code location and what to use instead.
    """
    if engine not in SUPPORT_ENGINES or not plan.is_quantized:
        return []
    layout = default_layout(engine, plan) if layout is None else layout
    if layout not in LAYOUTS:
        return []  # bf16 and native pass-through layouts: nothing the trainer exports
    found = [verdict(c) for c in plan_cells(engine, plan, layout)]
    for v in found:
        if not v.shown:
            c = v.cell
            raise EngineCellUnsupported(
                f"rollout.name={engine} ({engine} {PINNED_ENGINES[engine]}) cannot serve {c.describe()} in the "
                f"{c.layout} layout: {v.reason} ({v.where[0]}); {v.instead}",
                engine=engine, layout=c.layout, role=c.role, fmt=c.fmt, activation=c.activation.value,
                reason=v.reason, where=v.where[0], instead=v.instead,
            )
    return found
