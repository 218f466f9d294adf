"""The engine profiles, by rollout.name: each plugin's (adapters.plugins), with every engine's rules.

Every engine's dispatch carries the rules every engine adds: a rule reports "n/a" for the engines
it is not about, so that `refit plan` lists the same rules whatever the engine.
"""

from __future__ import annotations

import attrs

from adapters.engine_profile import StaticEngineProfile
from adapters.plugins import PLUGINS
from domain import environment
from domain.errors import ConfigError
from domain.quant import dispatch
from domain.quant.backend_policy import BackendDecision, decide_backends
from domain.quant.dispatch_types import DispatchInput, EngineDispatch, Resolution
from domain.quant.model_rules import Shapes
from domain.quant.plan import QuantizationPlan
from ports.engine_profile import EngineProfile

_OWN: tuple[StaticEngineProfile, ...] = tuple(p.profile for p in PLUGINS.values())
_ENGINE_RULES = tuple(r for p in _OWN for r in p.dispatch.rules)


def _with_every_rule(profile: StaticEngineProfile) -> StaticEngineProfile:
    return attrs.evolve(profile, dispatch=attrs.evolve(profile.dispatch, rules=_ENGINE_RULES))


# Typed as the port, so that mypy checks each profile satisfies it.
PROFILES: dict[str, EngineProfile] = {p.name: _with_every_rule(p) for p in _OWN}
ENGINES = tuple(PROFILES)
# Versions the adapters are pinned to, by engine (the engines that have one).
PINNED_ENGINES: dict[str, str] = {p.name: p.pinned_version for p in _OWN if p.pinned_version is not None}
# Distributions `refit doctor` reports: domain.environment's and every engine's package.
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    **environment.DISTRIBUTIONS, **{p.package: (p.package,) for p in _OWN if p.package is not None}}
# The engines with a support table (docs/support-matrix.md has a section for each).
SUPPORT_ENGINES = tuple(p.name for p in _OWN if p.support is not None)
POLICY_ENGINES = tuple(p.name for p in _OWN if p.backend_policy is not None)


def profile_for(name: str) -> EngineProfile:
    """The profile of rollout.name.

    Args:
        name: rollout.name.

    Returns:
        The profile. Raises ConfigError naming rollout.name and the engines there are.
    """
    if name not in PROFILES:
        raise ConfigError("rollout.name", f"unknown engine {name!r}; use one of {', '.join(PROFILES)}")
    return PROFILES[name]


def dispatch_for(name: str) -> EngineDispatch:
    """The engine's part in the dispatch rules (profile_for(name).dispatch)."""
    return profile_for(name).dispatch


def resolve(inp: DispatchInput, shapes: Shapes | None = None) -> Resolution:
    """The dispatch rules for `inp`, with the rules of its engine (rollout.name)'s profile.

    Args:
        inp: the dispatch input.
        shapes: the model's (name, shape) pairs, or None.

    Returns:
        domain.quant.dispatch.resolve's Resolution.
    """
    return dispatch.resolve(inp, shapes, engine=dispatch_for(inp.engine))


def backend_decision(engine: str, plan: QuantizationPlan, capability: tuple[int, int] | None = None, *,
                     opt_out: bool = False, layout: str | None = None) -> BackendDecision:
    """The kernel backends for a rollout engine, by its name (docs/engines.md#kernel-backends-backend-policy).

    Args:
        engine: rollout.name.
        plan: the resolved rollout quantization plan.
        capability: the GPU's compute capability, or None when unknown.
        opt_out: restore automatic selection everywhere.
        layout: the resolution's checkpoint layout (None: read from the plan).

    Returns:
        The BackendDecision. Raises ConfigError for an engine without a policy, and
        GpuCapabilityTooLow when the GPU lacks the kernels of a preset the plan uses.
    """
    policy = PROFILES[engine].backend_policy if engine in PROFILES else None
    if policy is None:
        raise ConfigError("rollout.name", f"no backend policy for {engine!r}; engines with one: "
                          f"{', '.join(POLICY_ENGINES)}")
    return decide_backends(policy, plan, capability, opt_out=opt_out, layout=layout)
