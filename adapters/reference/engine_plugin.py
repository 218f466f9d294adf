"""The embedded reference engine as a plugin (adapters.engine_plugin): pure torch, in this
process, at the embedded model's shapes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from adapters.engine_plugin import EnginePlugin, EngineRequest
from adapters.reference.profile import REFERENCE

if TYPE_CHECKING:
    from adapters.reference.engine import ReferenceEngine


def build(request: EngineRequest) -> ReferenceEngine:
    """A ReferenceEngine of the embedded model's shapes, its live layout that of the request's plan."""
    from adapters.reference.factory import build_reference_engine

    host = request.host
    return build_reference_engine(host.embedded_config(), request.plan, commit_mode=request.commit_mode,
                                  kv_cache_scheme=request.kv_cache_scheme, device=host.embedded_device)


PLUGIN = EnginePlugin(REFERENCE, "adapters.reference.engine.ReferenceEngine", build, embedded=True)
