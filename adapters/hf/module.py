"""A TrainerModel over a live Hugging Face `transformers` causal LM (what FSDP/TRL-style trainers
hold): its parameters under the names its checkpoint has (adapters.hf.names), log-probs from its
own forward."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from adapters.hf.names import checkpoint_names
from adapters.reference.model import log_probs_from_logits
from adapters.reference.trainer import perturb_tensors_
from domain.errors import CheckpointError
from domain.forward.fused_logprob import fused_logprob_entropy

# config fields through which a transformers model changes its logits after the head's matmul
# (Gemma's soft-capping, Cohere's and Granite's scales): such models are scored from their logits
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@attrs.define
class HfModuleTrainer:
    """A TrainerModel: a `transformers` model (`PreTrainedModel`, or any module with the same
    `named_parameters`, `config` and `forward(input_ids=...).logits`).

    Attributes:
        model: the model (its parameters are read, never copied).
        source_config: the config.json the model was loaded from, written unchanged by `save`
            (None: `model.config.to_dict()`).
    """

    model: Any
    source_config: dict[str, Any] | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> HfModuleTrainer:
        """Load a checkpoint directory as a transformers model (the whole model in memory).

        Raises:
            ModuleNotFoundError: naming the adapter when transformers is missing.
            CheckpointError: the directory has no config.json transformers can build a model of.
        """
        try:
            from transformers import AutoModelForCausalLM
        except ModuleNotFoundError as err:
            raise ModuleNotFoundError("HfModuleTrainer needs transformers", name="transformers") from err
        directory = Path(path)
        config_file = directory / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"{directory}: no config.json; pass a Hugging Face checkpoint directory")
        try:
            model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype)
        except (ValueError, KeyError, OSError) as err:
            raise CheckpointError(f"{directory}: transformers cannot load it as a causal LM ({err})") from None
        model.eval()
        return cls(model, json.loads(config_file.read_text()))

    @property
    def config(self) -> Any:
        """The model's transformers config (`vocab_size`, `tie_word_embeddings`, ...)."""
        return self.model.config

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) in the model's order; tied parameters once, fused experts
        per expert (views: nothing is copied)."""
        return checkpoint_names(self.model.named_parameters())

    def num_bytes(self) -> int:
        """Bytes of every parameter (shared ones once)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def log_probs(self, input_ids: torch.Tensor, *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of each next token and entropies, float32 [B, T - 1] on the host.

        Computed on the model's device through the fused, chunked path
        (domain.forward.fused_logprob): the decoder's final hidden states against the output
        weight, chunk by chunk, never the [B, T, V] logits. A model whose logits are more than
        `hidden @ W^T` (a head with a bias, soft-capped or scaled logits) is scored from its own
        logits instead, still on its device.
        """
        vocab = int(self.config.vocab_size)
        if input_ids.dtype != torch.int64 or input_ids.dim() != 2 or input_ids.shape[1] < 2:
            raise ValueError(f"input_ids must be int64 [B, T] with T >= 2, got {input_ids.dtype} {tuple(input_ids.shape)}")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
            raise ValueError(f"input_ids must lie in [0, {vocab}), the model's vocabulary")
        device = next(self.model.parameters()).device
        ids = input_ids.to(device)
        head = self._plain_head()
        with torch.no_grad():
            if head is None:
                logits = self.model(input_ids=ids).logits
                logp, entropy = log_probs_from_logits(logits, ids, temperature)
            else:
                hidden = self.model.get_decoder()(input_ids=ids).last_hidden_state
                logp, entropy = fused_logprob_entropy(hidden[:, :-1], head.weight, ids[:, 1:], temperature=temperature)
        return logp.float().cpu(), entropy.float().cpu()

    def _plain_head(self) -> Any:
        """The output layer when the logits are exactly `decoder output @ weight^T` (a Linear
        without bias, no soft-capping or scaling in the config), else None."""
        get_decoder = getattr(self.model, "get_decoder", None)
        get_head = getattr(self.model, "get_output_embeddings", None)
        if get_decoder is None or get_head is None:
            return None
        head = get_head()
        if not isinstance(head, torch.nn.Linear) or head.bias is not None:
            return None
        config = self.config
        if any(getattr(config, k, None) not in (None, 1, 1.0) for k in _LOGIT_TRANSFORMS):
            return None
        return head

    # --- what the demo does to a trainer ----------------------------------------------------

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of every parameter (`restore_` puts it back)."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    @torch.no_grad()
    def restore_(self, snapshot: dict[str, torch.Tensor]) -> None:
        """Copy a `snapshot()` back into the parameters, in place."""
        for n, p in self.model.named_parameters():
            p.copy_(snapshot[n])

    def perturb_(self, seed: int, scale: float = 0.01) -> None:
        """A training-like step on every parameter in place (adapters.reference.trainer.perturb_tensors_)."""
        perturb_tensors_((p.detach() for p in self.model.parameters()), seed, scale)

    def save(self, directory: str | Path) -> Path:
        """The current weights as a BF16 Hugging Face checkpoint: config.json (the source's,
        unchanged) and model.safetensors under the names `named_weights` yields.

        Returns:
            The directory (created).
        """
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        config = self.source_config if self.source_config is not None else json.loads(self.model.config.to_json_string())
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tensors = {n: t.contiguous().clone() for n, t in self.named_weights()}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
