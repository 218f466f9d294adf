"""The TRT-LLM engine's profile: no support table, no backend policy, and the dispatch rule
TrtllmBf16Only (TRT-LLM accepts no rollout quantization; docs/plan.md#trtllmbf16only)."""

from __future__ import annotations

from adapters.engine_profile import NATIVE_LAYOUTS, StaticEngineProfile
from domain.errors import EngineRejectsQuantization
from domain.keys import key
from domain.quant.dispatch_types import DispatchContext, EngineDispatch, Rule

NAME = "trtllm"


def check_no_quantization(ctx: DispatchContext) -> None:
    """TrtllmBf16Only: TRT-LLM accepts no rollout quantization (docs/plan.md#trtllmbf16only).

    Args:
        ctx: the resolved dispatch context.

    Returns:
        None. Raises EngineRejectsQuantization naming vLLM and SGLang.
    """
    if ctx.quantized:
        name = key("rollout", "name")
        raise EngineRejectsQuantization(
            f"{name}=trtllm accepts no rollout quantization; use {name}=vllm or "
            f"{name}=sglang, or set {key('quantization', 'linear')} and moe to null"
        )


# Every engine lists it (n/a for the others), as `refit plan` always has.
BF16_ONLY = Rule("TrtllmBf16Only", "TRT-LLM restrictions", check_no_quantization, engine=NAME)

TRTLLM = StaticEngineProfile(NAME, EngineDispatch(NAME, NATIVE_LAYOUTS, rules=(BF16_ONLY,)))
