"""The one class every engine profile is an instance of (ports.engine_profile.EngineProfile),
and the checkpoint layouts a native quantization_config names, which every engine is asked to read.

Each engine adapter builds its profile in `adapters/<engine>/profile.py`; `adapters.profiles`
lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import attrs

from domain.quant.backend_policy import BackendPolicy
from domain.quant.dispatch_types import EngineDispatch
from domain.quant.plan import QuantizationPlan
from domain.quant.support import NATIVE_FP8, Cell, SupportTable, table_cells

# SGLang's native MXFP8 layout (`quant_method: mxfp8`, block scales `weight_scale_inv`).
SGLANG_MXFP8 = "sglang-mxfp8"
# A native quantization_config's quant_method -> the layout an engine is asked to read it in.
NATIVE_LAYOUTS: Mapping[str, str] = MappingProxyType({"fp8": NATIVE_FP8, "mxfp8": SGLANG_MXFP8})


def _no_checks(plan: QuantizationPlan) -> None:
    return None


@attrs.frozen
class StaticEngineProfile:
    """An engine profile as plain values (satisfies ports.engine_profile.EngineProfile).

    Attributes:
        name: rollout.name.
        dispatch: the engine's part in the dispatch rules.
        package: the engine's distribution, None for an embedded engine.
        pinned_version: the release the adapter is pinned to, None when there is none.
        backend_policy: the engine's backend policy, None when it has none.
        table_layouts: preset -> the layouts besides compressed-tensors its support table covers.
        any_activation_layouts: those of them that carry any exportable activation scheme.
        adapter_checks: the checks the adapter makes itself when a refit begins.
    """

    name: str
    dispatch: EngineDispatch
    package: str | None = None
    pinned_version: str | None = None
    backend_policy: BackendPolicy | None = None
    table_layouts: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)
    any_activation_layouts: tuple[str, ...] = ()
    adapter_checks: Callable[[QuantizationPlan], None] = _no_checks

    def __attrs_post_init__(self) -> None:
        if self.dispatch.name != self.name:
            raise ValueError(f"profile {self.name!r} carries the dispatch rules of {self.dispatch.name!r}")

    @property
    def support(self) -> SupportTable | None:
        return self.dispatch.support

    def support_cells(self) -> list[Cell]:
        if self.support is None:
            return []
        return table_cells(self.name, self.table_layouts, self.any_activation_layouts)

    def check_plan(self, plan: QuantizationPlan) -> None:
        self.adapter_checks(plan)
