"""A TrainerModel over a Hugging Face checkpoint directory, streamed: each tensor is read from its
safetensors file when the refit reaches it (adapters.hf_checkpoint.reader), so a refit from a
directory holds no copy of the model, only the tensors in flight."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import structlog
import torch

from adapters.hf.names import tie_word_embeddings
from adapters.hf_checkpoint.reader import HfCheckpoint

log = structlog.get_logger()

LM_HEAD = "lm_head.weight"


@attrs.define
class HfCheckpointTrainer:
    """A TrainerModel: the weights of a checkpoint directory, as its files hold them.

    A tied model (`tie_word_embeddings: true`) yields no `lm_head.weight` (engines tie the head
    to the embeddings and never load it); a copy the files keep anyway is skipped.

    Attributes:
        checkpoint: the directory's reader (headers only until tensors are asked for).
    """

    checkpoint: HfCheckpoint
    _module: Any = attrs.field(init=False, default=None)

    @classmethod
    def open(cls, path: str | Path) -> HfCheckpointTrainer:
        """The checkpoint at `path` (CheckpointError naming what is wrong with it)."""
        return cls(HfCheckpoint(path))

    @property
    def path(self) -> Path:
        return self.checkpoint.path

    @property
    def tied(self) -> bool:
        """The checkpoint's config ties the LM head to the embeddings (or says nothing and its
        files have no LM head)."""
        said = tie_word_embeddings(self.checkpoint.config)
        if said is None:
            return LM_HEAD not in {n for n, _ in self.checkpoint.tensor_shapes()}
        return said

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) in layer order, one tensor read at a time (logical view: tensors a
        checkpoint stores quantized are decoded)."""
        skip = LM_HEAD if self.tied else None
        for name, t in self.checkpoint.iter_tensors():
            if name == skip:
                log.debug("tied model: the checkpoint's lm_head.weight is not sent", path=str(self.path))
                continue
            yield name, t

    def num_bytes(self) -> int:
        """Bytes of every tensor in the files (headers only)."""
        return self.checkpoint.total_bytes

    def log_probs(self, input_ids: torch.Tensor, *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores from the checkpoint loaded as a transformers model: loaded on the first call and
        kept (the only time this trainer holds the whole model)."""
        if self._module is None:
            from adapters.hf.module import HfModuleTrainer

            self._module = HfModuleTrainer.from_pretrained(self.path, dtype=self.checkpoint.logical_dtype)
        return self._module.log_probs(input_ids, temperature=temperature)
