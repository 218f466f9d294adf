"""CPU fakes shaped like vLLM's and SGLang's objects, for the adapters' tests and the contract suite."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _contract_stream() -> tuple[tuple[str, torch.Tensor], ...]:
    from tests import refit_support as rs

    return tuple(rs.stream(rs.trainer()))


def stream_engine(engine: str, vocab_size: int):  # type: ignore[no-untyped-def]
    """The vLLM or SGLang adapter over a fake engine whose model holds exactly the tensors of the
    contract suite's refit stream (tests/refit_support.py).

    SGLang rejects per-token NVFP4, so its adapter is built with the same presets and static
    NVFP4 activations (the plan only selects the staging rule; the tensors are the stream's).
    """
    if engine == "vllm":
        from tests.engine_fakes.vllm import stream_engine as vllm_engine

        return vllm_engine(list(_contract_stream()), vocab_size)
    from domain.quant.plan import QuantizationPlan
    from tests.engine_fakes.sglang import stream_engine as sglang_engine

    plan = QuantizationPlan.from_presets("FP8_BLOCK", "NVFP4", moe_activation="nvfp4_static")
    return sglang_engine(list(_contract_stream()), plan, vocab_size)
