"""A transformers model's parameters under the names its checkpoint has.

transformers 5 keeps a Qwen3-MoE layer's experts fused (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]) and `save_pretrained` splits them back into per-expert Linear
weights (`mlp.experts.{e}.gate_proj.weight`, ...), which is what engines load. Tied parameters
(`lm_head.weight` of a tied model) are one Parameter that `named_parameters` lists once, under
its first name (`model.embed_tokens.weight`), as `save_pretrained` writes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

_FUSED_GATE_UP = ".experts.gate_up_proj"
_FUSED_DOWN = ".experts.down_proj"


def checkpoint_names(named_parameters: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every parameter, fused experts as per-expert views.

    Args:
        named_parameters: a model's `named_parameters()` (shared parameters listed once).

    Returns:
        An iterator in the model's order; expert tensors are views of the fused parameter.
    """
    for name, p in named_parameters:
        t = p.detach()
        if name.endswith(_FUSED_GATE_UP) and t.dim() == 3:
            base, inter = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{base}{e}.gate_proj.weight", t[e, :inter]
                yield f"{base}{e}.up_proj.weight", t[e, inter:]
        elif name.endswith(_FUSED_DOWN) and t.dim() == 3:
            base = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                yield f"{base}{e}.down_proj.weight", t[e]
        else:
            yield name, t


def tie_word_embeddings(config: dict[str, object]) -> bool | None:
    """`tie_word_embeddings` of a config.json, top level, else under `text_config`; None when it
    does not say (`save_pretrained` leaves out a value equal to the model type's default, which
    differs between model types)."""
    for section in (config, config.get("text_config")):
        if isinstance(section, dict) and "tie_word_embeddings" in section:
            return bool(section["tie_word_embeddings"])
    return None
