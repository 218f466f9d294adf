"""A real in-process `vllm.LLM` behind the adapter's seams: its workers' refit steps through rl-refit's
worker extension (`ExtensionWorkers`), prompt log-probs and greedy tokens.

vllm is imported only inside these functions.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from adapters.vllm.lora import LoraServing, lora_request
from adapters.vllm.profile import VLLM_RANGE
from adapters.vllm.protocol import (
    EXTENSION,
    Abort,
    Begin,
    Finalize,
    FinalizeReply,
    Load,
    R,
    Request,
    WorkerQueries,
    replies_of,
)
from domain.refit.buckets import Bucket, unpack_bucket


@attrs.define
class LlmLogProbs:
    """log p(token_t | tokens_<t) for every position after the first, from vLLM's prompt log-probs.

    vLLM does not report the entropy of its distributions; the entropy returned is NaN.
    """

    llm: Any

    def __call__(self, input_ids: torch.Tensor, temperature: float = 1.0,
                 lora: LoraServing | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if input_ids.dim() != 2 or input_ids.shape[1] < 2:
            raise ValueError(f"input_ids must be [B, T] with T >= 2, got {tuple(input_ids.shape)}")
        params = SamplingParams(max_tokens=1, temperature=temperature, prompt_logprobs=0)
        prompts = [TokensPrompt(prompt_token_ids=row.tolist()) for row in input_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request(lora))
        rows = []
        for row, out in zip(input_ids.tolist(), outputs, strict=True):
            per_pos = out.prompt_logprobs[1:]  # position 0 has no log-prob
            rows.append([float(pos[tok].logprob) for tok, pos in zip(row[1:], per_pos, strict=True)])
        logp = torch.tensor(rows, dtype=torch.float32)
        return logp, torch.full_like(logp, math.nan)


@attrs.define
class LlmGreedy:
    """Greedy continuations from an in-process `LLM` (VllmRolloutEngine's greedy_fn)."""

    llm: Any

    def __call__(self, prompts: list[list[int]], max_tokens: int, lora: LoraServing | None = None) -> list[list[int]]:
        return greedy_tokens(self.llm, prompts, max_tokens, lora)


def greedy_tokens(llm: Any, prompts: list[list[int]], max_tokens: int,
                  lora: LoraServing | None = None) -> list[list[int]]:
    """Greedy continuations (temperature 0) of token-id prompts (with a LoRA adapter, if named),
    one request at a time.

    One at a time so that the tokens depend on the weights alone. Given together, the engine
    decodes the requests that reached its scheduler in the same step as one batch, and which did
    is a matter of timing (a multiprocess engine receives them one by one). A GEMM's row is not
    the same bits at every row count (MKL's FP32 GEMM, for one, takes another path below 4 rows),
    so at a near-tie the argmax, and every token after it, could follow the timing.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = lora_request(lora)
    tokens = []
    for prompt in prompts:
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False, lora_request=request)
        tokens.append(list(out.outputs[0].token_ids))
    return tokens


def start_llm(**engine_kwargs: Any) -> Any:
    """`vllm.LLM(**engine_kwargs)` (see engine_args.vllm_engine_kwargs; apply
    engine_args.vllm_environment first). Raises ModuleNotFoundError naming the adapter when vllm
    is not installed."""
    try:
        from vllm import LLM
    except ModuleNotFoundError as err:
        if err.name is None or not err.name.startswith("vllm"):
            raise
        raise ModuleNotFoundError(
            f"adapters.vllm (VllmRolloutEngine) needs vllm {VLLM_RANGE} (pip install 'rl-refit[vllm]')",
            name="vllm") from err
    return LLM(**engine_kwargs)


@attrs.define
class ExtensionWorkers(WorkerQueries):
    """The refit steps inside the workers of an in-process `vllm.LLM` started with rl-refit's
    worker extension (protocol.EXTENSION), through `LLM.collective_rpc`: one request record
    per call (adapters.vllm.protocol), its reply record back, a worker's error raised as its own
    class.

    Colocated: with `VLLM_ENABLE_V1_MULTIPROCESSING=0` and one worker the bucket's tensors reach
    the worker by reference (the worker copies them before the call returns). With the
    multiprocess engine, tensors do not survive collective_rpc: attach to it (adapters.vllm.attached).
    """

    llm: Any

    @classmethod
    def launch(cls, **engine_kwargs: Any) -> ExtensionWorkers:
        """Start `vllm.LLM(**engine_kwargs)` with the extension (apply
        engine_args.vllm_environment(colocated=True) first)."""
        return cls(start_llm(**{"worker_extension_cls": EXTENSION, **engine_kwargs}))

    def call_all(self, request: Request[R]) -> list[R]:
        """Every worker's reply to `request`; raises a worker's error as its own class."""
        return replies_of(request, self.llm.collective_rpc(request.METHOD, args=(request.to_plain(),)))

    def begin(self) -> None:
        self.call(Begin())

    def load(self, bucket: Bucket) -> int:
        return self.call(Load(tuple(unpack_bucket(bucket)), retained=bucket.retained)).tensors

    def finalize(self, reset_kv_scales: bool) -> FinalizeReply:
        return self.call(Finalize(reset_kv_scales))

    def abort(self) -> None:
        self.call(Abort())

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut the in-process engine down."""
        shutdown_llm(self.llm)


def shutdown_llm(llm: Any) -> None:
    """Stop an `LLM`'s engine core (and its worker processes, with the multiprocess engine)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
