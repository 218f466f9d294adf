"""The SGLang engine, built from its configuration section and the start resolved for a plan."""

from __future__ import annotations

import shlex
from typing import Any

from adapters.engine_start import EngineStart, check_commit_mode
from adapters.sglang.config import SglangEngineConfig
from adapters.sglang.engine import SglangRolloutEngine
from adapters.sglang.engine_args import sglang_engine_kwargs
from domain.refit.session import CommitMode


def sglang_kwargs(section: SglangEngineConfig, start: EngineStart) -> dict[str, Any]:
    """The SGLang server arguments for one start: the model, the user's model-config overrides
    (SGLang's json_model_override_args) with the plan's quantization_config, the kernels."""
    base: dict[str, Any] = {}
    if section.hf_overrides is not None:  # SGLang's name for the model-config overrides
        base["json_model_override_args"] = dict(section.hf_overrides)
    if start.model_path:
        base["model"] = start.model_path
    return sglang_engine_kwargs(start.quantization_config, start.decision, kv_cache_dtype=section.kv_cache_dtype,
                                base=base)


def build_sglang_engine(section: SglangEngineConfig, start: EngineStart, *, sync_backend: str, wire_format: str,
                        commit_mode: CommitMode | None = None) -> SglangRolloutEngine:
    """A started SGLang engine configured for `start.plan`.

    Args:
        section: rollout.engine_kwargs.sglang.
        start: the plan, its quantization_config, layout and backend decision.
        sync_backend: rollout.checkpoint_engine.backend.
        wire_format: rollout.wire_format.
        commit_mode: rollout.commit_mode (SGLang commits transactionally only).
    """
    from adapters.sglang.client import EngineClient

    check_commit_mode(commit_mode, CommitMode.TRANSACTIONAL, "sglang")
    return SglangRolloutEngine(EngineClient.launch(**sglang_kwargs(section, start)), start.plan,
                               native_mxfp8=start.layout == "sglang-mxfp8", sync_backend=sync_backend,
                               wire_format=wire_format)


def attach_sglang_engine(section: SglangEngineConfig, start: EngineStart, *, sync_backend: str, wire_format: str,
                         commit_mode: CommitMode | None = None) -> SglangRolloutEngine:
    """An engine over the SGLang server at `section.url`, which the user started
    (rollout.deployment: attached): probed first, never stopped by rl-refit (docs/attach.md)."""
    from adapters.sglang.http_client import attach

    check_commit_mode(commit_mode, CommitMode.TRANSACTIONAL, "sglang")
    if not section.url:
        raise ValueError("attach_sglang_engine needs rollout.engine_kwargs.sglang.url")
    kwargs = sglang_kwargs(section, start)
    flags = " ".join(f"--{k.replace('_', '-')} {shlex.quote(str(v))}"
                     for k, v in kwargs.items() if k in ("quantization", "json_model_override_args"))
    return attach(section.url, start.plan, model=start.model_path or None, quantization=kwargs.get("quantization"),
                  server_flags=flags, pause_mode=section.pause_mode,
                  api_key=section.api_key, native_mxfp8=start.layout == "sglang-mxfp8", sync_backend=sync_backend,
                  wire_format=wire_format)
