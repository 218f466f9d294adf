"""A TrainerModel over a Megatron-Core GPTModel, scoring tokens through the fused forward.

`MegatronTrainerModel.build(model, requested_mode)` decides the fused-forward mode once (see
`adapters.megatron.fused_forward`) and then `log_probs` calls the model the way that mode
wants: `output_processor=` / `output_processor_context=` in hook mode, `temperature=` in legacy
mode. `log_probs_packed` scores variable-length sequences packed in THD layout.
`named_weights` yields Hugging Face names for dense models without tensor/pipeline parallelism.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch

from adapters.megatron.fused_forward import (
    FusedContext,
    Gather,
    make_output_processor,
    resolve_fused_forward,
    unwrap_model,
)
from adapters.megatron.thd import packed_seq_params, plan_packing
from domain.errors import FusedForwardUnsupported, InvalidTensor, MegatronModelUnsupported
from domain.forward.fused_logprob import IGNORE_INDEX, validate_temperature
from domain.forward.mode import FusedForwardMode

try:
    from megatron.core import parallel_state
except ImportError as err:  # pragma: no cover - exercised only without megatron-core
    raise ModuleNotFoundError(
        "adapters.megatron.trainer_model needs megatron-core (the `megatron` extra)", name="megatron.core"
    ) from err


def _parallel_size(name: str) -> int:
    getter = getattr(parallel_state, f"get_{name}_world_size", None)
    try:
        return int(getter()) if getter is not None else 1
    except (AssertionError, RuntimeError):  # parallel state not initialized: one process
        return 1


@attrs.define
class MegatronTrainerModel:
    """TrainerModel port over a (possibly wrapped) Megatron GPTModel.

    Attributes:
        model: the model as built (Float16Module, DDP, ... allowed).
        mode: the fused-forward mode decided at build (HOOK or LEGACY).
        chunk_size: tokens per chunk of the fused computation (None: from the vocabulary).
    """

    model: torch.nn.Module
    mode: FusedForwardMode
    chunk_size: int | None = None
    _processor: Any = attrs.field(default=None, alias="processor")

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        requested: FusedForwardMode = FusedForwardMode.AUTO,
        *,
        chunk_size: int | None = None,
        gather: Gather | None = None,
    ) -> MegatronTrainerModel:
        """Decide the fused-forward mode once and wrap the model.

        Args:
            model: the model as built.
            requested: AUTO, HOOK or LEGACY (parsed by the composition root).
            chunk_size: tokens per chunk of the fused computation.
            gather: sequence-parallel gather seam (tests); default Megatron's.

        Returns:
            The adapter.
        """
        mode = resolve_fused_forward(model, requested, chunk_size=chunk_size, gather=gather)
        return cls(model, mode, chunk_size, processor=make_output_processor(gather=gather))

    @property
    def real_model(self) -> torch.nn.Module:
        """The unwrapped GPTModel (where the mode is stored)."""
        return unwrap_model(self.model)[0]

    def _call(self, *args: Any, temperature: float, **kwargs: Any) -> dict[str, torch.Tensor]:
        real, via_language_model = unwrap_model(self.model)
        target = real if via_language_model else self.model  # a VLM's text path is its language model
        if self.mode is FusedForwardMode.HOOK:
            ctx = FusedContext(temperature=temperature, chunk_size=self.chunk_size)
            return target(*args, output_processor=self._processor, output_processor_context=ctx, **kwargs)
        return target(*args, temperature=temperature, **kwargs)

    def _check_single_stage(self) -> None:
        if _parallel_size("pipeline_model_parallel") > 1:
            raise FusedForwardUnsupported(
                "log_probs runs the whole model in one call; with pipeline parallelism call the "
                "model through Megatron's schedule with the output processor of this adapter"
            )

    def log_probs(
        self, input_ids: torch.Tensor, *, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-prob of each next token and entropy of each next-token distribution.

        Args:
            input_ids: int64 [B, T] token ids, T >= 2.
            temperature: logits are divided by it.

        Returns:
            (log_probs, entropy), float32 [B, T - 1]: position t scores input_ids[:, t + 1].
        """
        validate_temperature(temperature)
        if input_ids.dim() != 2 or input_ids.shape[1] < 2 or input_ids.dtype.is_floating_point:
            raise InvalidTensor("input_ids", f"shape {tuple(input_ids.shape)} / {input_ids.dtype}", "pass int64 [B, T >= 2]")
        self._check_single_stage()
        batch, seq = input_ids.shape
        device = input_ids.device
        position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)
        # Megatron's convention: True = masked. Explicit, because its default mask is built on CUDA.
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)[None, None]
        labels = torch.cat([input_ids[:, 1:], torch.full_like(input_ids[:, :1], IGNORE_INDEX)], dim=1)
        out = self._call(input_ids, position_ids, mask, labels=labels, temperature=temperature)
        return out["log_probs"][:, :-1].float(), out["entropy"][:, :-1].float()

    def log_probs_packed(
        self, sequences: Sequence[torch.Tensor], *, temperature: float = 1.0
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Score variable-length sequences packed in THD layout (one forward, no padding to max).

        Needs an attention implementation that takes `packed_seq_params` (Transformer Engine);
        the layout's alignment follows the model's training recipe, tp and cp (cp = 1 only).

        Args:
            sequences: int64 [L_i] token ids, each L_i >= 2.
            temperature: logits are divided by it.

        Returns:
            One (log_probs, entropy) pair per sequence, float32 [L_i - 1] each.
        """
        validate_temperature(temperature)
        self._check_single_stage()
        cp = _parallel_size("context_parallel")
        if cp > 1:
            raise FusedForwardUnsupported("log_probs_packed does not split sequences across context-parallel ranks")
        bad = [i for i, s in enumerate(sequences) if s.dim() != 1 or s.shape[0] < 2]
        if not sequences or bad:
            raise InvalidTensor("sequences", f"entries {bad} are not 1-D with >= 2 tokens", "pass int64 [L >= 2] each")
        real = self.real_model
        layout = plan_packing(real.config, [s.shape[0] for s in sequences], tp=_parallel_size("tensor_model_parallel"))
        device = sequences[0].device
        ids = layout.pack(list(sequences)).unsqueeze(0)
        labels = layout.next_token_labels(ids[0], IGNORE_INDEX).unsqueeze(0)
        params = packed_seq_params(layout, device=device)
        out = self._call(
            ids, layout.position_ids(device).unsqueeze(0), None,
            labels=labels, packed_seq_params=params, temperature=temperature,
        )
        lps = layout.unpack(out["log_probs"][0].float(), drop_last=True)
        ents = layout.unpack(out["entropy"][0].float(), drop_last=True)
        return list(zip(lps, ents, strict=True))

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, full tensor) in layer order, for dense and MoE GPT models.

        Returns:
            An iterator; q/k/v and gate/up are split out of Megatron's fused tensors, experts are
            named by their index (see `adapters.megatron.hf_names`).
        """
        split = [k for k in ("tensor_model_parallel", "pipeline_model_parallel", "expert_model_parallel")
                 if _parallel_size(k) > 1]
        if split:
            raise MegatronModelUnsupported(
                f"named_weights gathers no shards and this model is split ({', '.join(split)} > 1); export with "
                "tp = pp = ep = 1, or refit a sharded trainer with the distributed refit (ShardedTrainerModel)"
            )
        from adapters.megatron.hf_names import hf_named_weights

        yield from hf_named_weights(self.real_model)
