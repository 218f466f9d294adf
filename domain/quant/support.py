"""The support matrix (dispatch rule EngineSupportMatrix, docs/plan.md#enginesupportmatrix): what an engine loads and runs, cell by cell.

A cell is one (engine, layout, role, preset, activations) combination that the trainer can
export. Each has a Verdict: shown (the engine code path that loads and runs the export is cited,
file:line in the pinned release, and where it runs, tested) or rejected (the engine's reason,
where in its code, and what to use instead). A SupportTable holds one engine's verdicts; each
engine adapter's profile builds its own (adapters/<engine>/profile.py), and `SupportTable.check`
applies one to a plan. docs/support-matrix.md is checked against the tables
(tests/unit/test_support_matrix.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

import attrs

from domain.errors import EngineCellUnsupported
from domain.keys import key
from domain.quant.formats import FORMATS, ActivationScheme
from domain.quant.plan import ACTIVATIONS, QuantizationPlan

ROLES = ("linear", "moe")
# The engine-neutral checkpoint layouts: BF16, compressed-tensors, a DeepSeek-style native
# `quant_method: fp8`, and a native layout the trainer cannot produce, passed through untouched.
# Every other layout name an engine profile chooses is an engine's own native layout (its Fp8Config),
# whose block scales are named `weight_scale_inv`.
BF16_LAYOUT = "bf16"
COMPRESSED_TENSORS = "compressed-tensors"
NATIVE_FP8 = "native-fp8"
NATIVE_PASSTHROUGH = "native-passthrough"
# ModelOpt's NVFP4 experts (domain.quant.modelopt_layout.LAYOUT): compressed-tensors' block scale
# name, its own element and global-scale names.
MODELOPT_NVFP4 = "modelopt-nvfp4"
NEUTRAL_LAYOUTS = (BF16_LAYOUT, COMPRESSED_TENSORS, NATIVE_PASSTHROUGH, MODELOPT_NVFP4)

# How a verdict was reached.
READ = "read"  # the cited engine code, read in the pinned release
CPU_ENGINE = "cpu"  # run on CPU against the engine's own code (the engine's CPU build, tests/<engine>/)
GPU_SCRIPT = "gpu-script"  # in the prepared GPU check (tests/gpu/check_support_matrix.py)
# served end to end by the engine's CPU build, every refit equal to a cold start bit for bit, the
# matmul emulated where the CPU has no kernel for it
CPU_SERVED = "cpu-served"
HOW = (READ, CPU_ENGINE, GPU_SCRIPT, CPU_SERVED)


def is_engine_native(layout: str) -> bool:
    """Whether a layout is read by the engine's own Fp8Config (block scales `weight_scale_inv`).

    Args:
        layout: a checkpoint layout name.

    Returns:
        True for NATIVE_FP8 and every engine's own layout; False for the NEUTRAL_LAYOUTS.
    """
    return layout not in NEUTRAL_LAYOUTS


def _role_key(role: str) -> str:
    return key("quantization", role)


@attrs.frozen
class Cell:
    """One combination an engine is asked to serve.

    Attributes:
        engine: the engine's name (rollout.name).
        layout: the checkpoint layout (COMPRESSED_TENSORS, NATIVE_FP8 or an engine's own).
        role: "linear" (dense Linear layers) or "moe" (routed experts).
        fmt: the preset name (FP8_BLOCK, MXFP8, MXFP4, NVFP4).
        activation: the role's activation scheme.
    """

    engine: str = attrs.field(validator=attrs.validators.min_len(1))
    layout: str = attrs.field(validator=attrs.validators.min_len(1))
    role: str = attrs.field(validator=attrs.validators.in_(ROLES))
    fmt: str = attrs.field(validator=attrs.validators.in_(tuple(FORMATS)))
    activation: ActivationScheme

    def describe(self) -> str:
        """`rollout.quantization.moe=NVFP4 with nvfp4_per_token activations`, as messages write it."""
        return f"{_role_key(self.role)}={self.fmt} with {self.activation.value} activations"


def cite(package: str, version: str, path: str, lines: str) -> str:
    """A code location in a pinned release: `<package> 0.33.0 <package>/model_executor/...py:796-797`.

    Args:
        package: the engine's distribution name.
        version: its pinned release.
        path: the file inside the wheel.
        lines: a line or a range.

    Returns:
        The citation string.
    """
    return f"{package} {version} {path}:{lines}"


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
        how: READ, plus CPU_ENGINE / GPU_SCRIPT / CPU_SERVED where a test runs it.
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


def table_cells(engine: str, native_layouts: Mapping[str, tuple[str, ...]],
                any_activation: tuple[str, ...] = ()) -> list[Cell]:
    """Every cell `refit plan` could ask an engine for: the domain its verdict table must cover.

    Args:
        engine: the engine's name.
        native_layouts: preset -> the layouts other than compressed-tensors an export of it can
            reach the engine in (a checkpoint's native `quant_method`, or the engine's own layout).
        any_activation: the native layouts that carry any exportable activation scheme (the
            others name only the preset's default activations).

    Returns:
        The cells, by preset, layout, role and activation scheme.
    """
    cells = []
    for fmt in (f for f in FORMATS if FORMATS[f].is_quantized):
        for layout in (COMPRESSED_TENSORS, *native_layouts.get(fmt, ())):
            acts = exportable_activations(fmt)
            if layout != COMPRESSED_TENSORS and layout not in any_activation:
                acts = (FORMATS[fmt].activation,)  # a native config names no other activations
            cells += [Cell(engine, layout, role, fmt, act) for role in ROLES for act in acts]
    return cells


def plan_cells(engine: str, plan: QuantizationPlan, layout: str) -> list[Cell]:
    """The cells a plan asks `engine` for (its quantized roles), in role order."""
    pairs = (("linear", plan.linear, plan.effective_linear_activation),
             ("moe", plan.moe, plan.effective_moe_activation))
    return [Cell(engine, layout, role, fmt.name, act) for role, fmt, act in pairs if fmt.is_quantized]


def _verdict_map(value: Iterable[Verdict]) -> Mapping[Cell, Verdict]:
    return MappingProxyType({v.cell: v for v in value})


@attrs.frozen
class SupportTable:
    """One engine's verdicts, for the release its adapter is pinned to.

    Attributes:
        engine: the engine's name (rollout.name); every verdict's cell names it.
        version: the pinned release the verdicts cite.
        verdicts: cell -> verdict (read-only; built from any iterable of verdicts).
    """

    engine: str
    version: str
    verdicts: Mapping[Cell, Verdict] = attrs.field(converter=_verdict_map)

    def __attrs_post_init__(self) -> None:
        strays = [c for c in self.verdicts if c.engine != self.engine]
        if strays:
            raise ValueError(f"{self.engine}'s support table holds cells of another engine: {strays[0]}")

    def verdict(self, cell: Cell) -> Verdict:
        """The verdict of one cell; a cell the table lacks is a bug in it (KeyError)."""
        return self.verdicts[cell]

    def check(self, plan: QuantizationPlan, layout: str) -> list[Verdict]:
        """EngineSupportMatrix: every cell of the plan must be shown for the engine.

        Args:
            plan: what the engine serves.
            layout: the checkpoint layout the engine reads it in.

        Returns:
            The verdicts of the plan's cells. Raises EngineCellUnsupported for the first rejected
            cell, with the engine's reason, its code location and what to use instead.
        """
        if not plan.is_quantized or layout in (BF16_LAYOUT, NATIVE_PASSTHROUGH):
            return []  # nothing the trainer exports
        found = [self.verdict(c) for c in plan_cells(self.engine, plan, layout)]
        for v in found:
            if not v.shown:
                c = v.cell
                raise EngineCellUnsupported(
                    f"{key('rollout', 'name')}={self.engine} ({self.engine} {self.version}) cannot serve "
                    f"{c.describe()} in the {c.layout} layout: {v.reason} ({v.where[0]}); {v.instead}",
                    engine=self.engine, layout=c.layout, role=c.role, fmt=c.fmt, activation=c.activation.value,
                    reason=v.reason, where=v.where[0], instead=v.instead,
                )
        return found
