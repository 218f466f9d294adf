"""The TRT-LLM engine's profile: no support table, no backend policy, and dispatch rule 7 (TRT-LLM
accepts no rollout quantization)."""

from __future__ import annotations

from adapters.engine_profile import NATIVE_LAYOUTS, StaticEngineProfile
from domain.errors import EngineRejectsQuantization
from domain.keys import key
from domain.quant.dispatch_types import DispatchContext, EngineDispatch, Rule

NAME = "trtllm"


def check_no_quantization(ctx: DispatchContext) -> None:
    """Rule 7: TRT-LLM accepts no rollout quantization.

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
RULE_7 = Rule(7, "TRT-LLM restrictions", check_no_quantization, engine=NAME)

TRTLLM = StaticEngineProfile(NAME, EngineDispatch(NAME, NATIVE_LAYOUTS, rules=(RULE_7,)))
