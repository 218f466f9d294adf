"""A real `vllm.LLM` behind the adapter's seams: its workers' refit steps (`LlmWorkers`), prompt
log-probs for the mismatch probe and the GPU check.

vllm is imported only inside these functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import torch

from adapters.vllm import worker
from adapters.vllm.worker import FinalizeStats
from domain.environment import PINNED_VLLM
from domain.refit.storage import StorageFingerprint


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


@attrs.define
class LlmWorkers:
    """The refit steps inside every worker of a `vllm.LLM`, through `LLM.collective_rpc`.

    Out-of-process workers receive callables by serialization: start the engine with
    `VLLM_ALLOW_INSECURE_SERIALIZATION=1` (engine_args.vllm_environment sets it).
    """

    llm: Any

    @classmethod
    def launch(cls, **engine_kwargs: Any) -> LlmWorkers:
        """Start `vllm.LLM(**engine_kwargs)` (see engine_args.vllm_engine_kwargs; apply
        engine_args.vllm_environment first). Raises ModuleNotFoundError naming the adapter
        when vllm is not installed."""
        try:
            from vllm import LLM
        except ModuleNotFoundError as err:
            if err.name is None or not err.name.startswith("vllm"):
                raise
            raise ModuleNotFoundError(
                f"adapters.vllm (VllmRolloutEngine) needs vllm=={PINNED_VLLM} (pip install 'vllm=={PINNED_VLLM}')",
                name="vllm") from err
        return cls(LLM(**engine_kwargs))

    def _rpc(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.llm.collective_rpc(fn, args=args)[0]

    def begin(self) -> None:
        self._rpc(worker.rpc_begin)

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        return int(self._rpc(worker.rpc_load, named_tensors))

    def finalize(self, reset_kv_scales: bool) -> FinalizeStats:
        return FinalizeStats(*self._rpc(worker.rpc_finalize, reset_kv_scales))

    def abort(self) -> None:
        self._rpc(worker.rpc_abort)

    def fingerprint(self) -> StorageFingerprint:
        return self._rpc(worker.rpc_fingerprint)

    def live_weights(self) -> dict[str, torch.Tensor]:
        return self._rpc(worker.rpc_live_weights)
