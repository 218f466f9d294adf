"""TRT-LLM as a plugin (adapters.engine_plugin): its profile only. rl-refit plans for it (its
dispatch rule refuses rollout quantization) but builds no engine of it."""

from __future__ import annotations

from adapters.engine_plugin import EnginePlugin
from adapters.trtllm.profile import TRTLLM

PLUGIN = EnginePlugin(TRTLLM, "TRT-LLM (planned only)")
