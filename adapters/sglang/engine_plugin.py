"""The SGLang engine as a plugin (adapters.engine_plugin): `sglang.Engine` in this process
(colocated), or a server the user started (attached; docs/attach.md#8-sglang)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from adapters.engine_plugin import ATTACHED, COLOCATED, EnginePlugin, EngineRequest, InProcessBackup
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


def backup() -> InProcessBackup:
    """SGLang's custom loader of rl-refit, measured in this process (adapters.sglang.inprocess)."""
    from adapters.sglang.inprocess import ROTARY_POSITIONS, harness

    return InProcessBackup(
        "SGLang",
        # SGLang serves neither per-token NVFP4 nor MXFP8 linear with MXFP4 experts (dispatch rule
        # EngineSupportMatrix)
        {"BF16": (None, None), "FP8_BLOCK/MXFP4": ("FP8_BLOCK", "MXFP4")},
        harness,
        "SGLang's custom loader of rl-refit in process, on a model shaped like SGLang's from the exported stream; "
        "it backs up, just before writing, the decoder layer (or module) a tensor goes to. The previous loader "
        "copied every parameter and buffer at BEGIN; the difference is what no refit writes (here a rotary cache "
        f"for {ROTARY_POSITIONS} positions and a vision patch embedding, which dominate on the small presets; on a "
        "real text model they are a small share, with a frozen tower the tower). A full refit still backs up every "
        "tensor it overwrites: that is the transactional bound")


PLUGIN = EnginePlugin(SGLANG, "adapters.sglang.engine.SglangRolloutEngine", build, frozenset({COLOCATED, ATTACHED}),
                      SglangEngineConfig, extra="sglang", backup=backup)
