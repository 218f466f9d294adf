"""Serving through a real `vllm.LLM`: prompt log-probs for the mismatch probe and the GPU check.

vllm is imported only inside these functions.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch


@attrs.define
class LlmLogProbs:
    """log p(token_t | tokens_<t) for every position after the first, from vLLM's prompt log-probs.

    vLLM does not report the entropy of its distributions; the entropy returned is NaN.
    """

    llm: Any

    def __call__(self, input_ids: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if input_ids.dim() != 2 or input_ids.shape[1] < 2:
            raise ValueError(f"input_ids must be [B, T] with T >= 2, got {tuple(input_ids.shape)}")
        params = SamplingParams(max_tokens=1, temperature=temperature, prompt_logprobs=0)
        prompts = [TokensPrompt(prompt_token_ids=row.tolist()) for row in input_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        rows = []
        for row, out in zip(input_ids.tolist(), outputs, strict=True):
            per_pos = out.prompt_logprobs[1:]  # position 0 has no log-prob
            rows.append([float(pos[tok].logprob) for tok, pos in zip(row[1:], per_pos, strict=True)])
        logp = torch.tensor(rows, dtype=torch.float32)
        return logp, torch.full_like(logp, math.nan)


def greedy_tokens(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations (temperature 0) of token-id prompts."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]
