"""Port: what the domain and the application need to know of one rollout engine."""

from __future__ import annotations

from typing import Protocol

from domain.quant.backend_policy import BackendPolicy
from domain.quant.dispatch_types import EngineDispatch
from domain.quant.plan import QuantizationPlan
from domain.quant.support import Cell, SupportTable


class EngineProfile(Protocol):
    """One rollout engine's knowledge, kept beside its adapter: its name and pinned release, its
    support table, layout choice and dispatch rules (as an EngineDispatch), its backend policy,
    and the checks only its adapter makes.

    Implementations: `adapters.vllm.profile.VLLM`, `adapters.sglang.profile.SGLANG`,
    `adapters.trtllm.profile.TRTLLM`, `adapters.reference.profile.REFERENCE`, all listed in
    `adapters.profiles.PROFILES` (the plain dict the composition root picks from).
    """

    @property
    def name(self) -> str:
        """rollout.name."""
        ...

    @property
    def package(self) -> str | None:
        """The engine's distribution (what `refit doctor` looks for), None for an embedded engine."""
        ...

    @property
    def pinned_version(self) -> str | None:
        """The engine release the adapter is written and checked against, None when there is none."""
        ...

    @property
    def dispatch(self) -> EngineDispatch:
        """The engine's part in the dispatch rules: layout choice, support table (EngineSupportMatrix), its rules."""
        ...

    @property
    def backend_policy(self) -> BackendPolicy | None:
        """Which kernels the engine is asked for; None: no policy
        (docs/engines.md#kernel-backends-backend-policy)."""
        ...

    @property
    def support(self) -> SupportTable | None:
        """The engine's support table (the same as `dispatch.support`); None: every cell passes."""
        ...

    def support_cells(self) -> list[Cell]:
        """Every cell `refit plan` could ask the engine for: what its support table must cover.

        Returns:
            The cells (empty for an engine without a support table).
        """
        ...

    def check_plan(self, plan: QuantizationPlan) -> None:
        """The checks the engine's adapter makes itself when a refit begins.

        Args:
            plan: the plan the engine serves.

        Returns:
            None. Raises the engine's typed error (EngineRejectsQuantization) when it cannot serve it.
        """
        ...
