"""The dispatch and the backend policy as the application runs them: an engine's rules, support
table and policy come from its profile (adapters.profiles), looked up by rollout.name."""

from __future__ import annotations

from collections.abc import Mapping

from adapters.profiles import PROFILES, SUPPORT_ENGINES, dispatch_for, profile_for, resolve
from adapters.profiles import backend_decision as decide_backends
from domain.quant.dispatch_types import DispatchInput, Resolution
from domain.quant.native_config import NativeConfig
from domain.quant.plan import QuantizationPlan
from domain.quant.support import Cell, Verdict

__all__ = ["SUPPORT_ENGINES", "DispatchInput", "Resolution", "all_cells", "check_cells", "decide_backends",
           "layout_for", "resolve", "verdicts"]


def verdicts() -> Mapping[Cell, Verdict]:
    """Every verdict of every engine's support table, by cell."""
    return {c: v for p in PROFILES.values() if p.support is not None for c, v in p.support.verdicts.items()}


def all_cells() -> list[Cell]:
    """Every cell the support tables must cover."""
    return [c for p in PROFILES.values() for c in p.support_cells()]


def check_cells(engine: str, plan: QuantizationPlan, layout: str | None = None) -> list[Verdict]:
    """EngineSupportMatrix for `engine` (its default layout when `layout` is None); [] without a support table."""
    table = profile_for(engine).support
    if table is None:
        return []
    return table.check(plan, dispatch_for(engine).default_layout(plan) if layout is None else layout)


def layout_for(engine: str, plan: QuantizationPlan, native: NativeConfig | None) -> str:
    """The layout `engine` reads a plan in."""
    return dispatch_for(engine).layout_for(plan, native)
