"""The SGLang engine as a plugin (adapters.engine_plugin): `sglang.Engine` in this process
(colocated), or a server the user started (attached; docs/attach.md#8-sglang)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from adapters.engine_plugin import ATTACHED, COLOCATED, EnginePlugin, EngineRequest
from adapters.sglang.config import SglangEngineConfig
from adapters.sglang.profile import SGLANG

if TYPE_CHECKING:
    from adapters.sglang.engine import SglangRolloutEngine


def build(request: EngineRequest) -> SglangRolloutEngine:
    """The SGLang engine of one request: attached to `url`, else started in this process."""
    section: SglangEngineConfig = request.section
    if request.deployment == ATTACHED:
        from adapters.sglang.factory import attach_sglang_engine

        section.attached_url(request.replica)
        return attach_sglang_engine(section, request.start(), sync_backend=request.sync_backend,
                                    wire_format=request.wire_format, commit_mode=request.commit_mode)
    from adapters.sglang.factory import build_sglang_engine

    return build_sglang_engine(section, request.start(), sync_backend=request.sync_backend,
                               wire_format=request.wire_format, commit_mode=request.commit_mode)


PLUGIN = EnginePlugin(SGLANG, "adapters.sglang.engine.SglangRolloutEngine", build, frozenset({COLOCATED, ATTACHED}),
                      SglangEngineConfig, extra="sglang")
