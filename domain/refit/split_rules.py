"""Which tensor tensor parallelism splits, and how: the dimension, GDN's sections, experts and MTP.

- tensor parallelism splits column-parallel weights (q/k/v, gate/up, embeddings, LM head, GDN
  input projections, the MTP input projection, and their biases) along rows, row-parallel
  weights (o_proj, down_proj, GDN out_proj) along K; GDN's conv1d, A_log and dt_bias follow their
  heads. The GDN q/k/v projection and conv1d are split section by section (each TP rank holds its
  share of q, of k and of v); expert tensor parallelism (etp > 1) splits each expert the same way;
  norms and routers are not split.
- routed experts are recognised by their index (`.experts.<e>.`), the multi-token-prediction (MTP)
  layers by their prefix: both decide which ranks hold a tensor (domain.refit.shard_map).

Rules on names and shapes only: the layout is in domain.refit.topology.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from domain.errors import ShardingError
from domain.quant import naming

_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_ROW_PARALLEL = ("o_proj", "down_proj", "w2", "out_proj")
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3",
                    "in_proj_z", "in_proj_b", "in_proj_a")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")
_MTP = re.compile(r"^(?:model\.)?mtp\.")  # multi-token prediction layers (Qwen3.5 / DeepSeek-V3 naming)
_MTP_FC = re.compile(r"^(?:model\.)?mtp\.(?:layers\.\d+\.)?fc$")  # the MTP input projection [H, 2H]
_GDN_SECTIONED = ("linear_attn.in_proj_qkv", "linear_attn.conv1d")  # [q; k; v] along dim 0
_GDN_HEADS = ("linear_attn.A_log", "linear_attn.dt_bias")  # one value per value head


def expert_index(name: str) -> int | None:
    """The routed expert a (Hugging Face) tensor belongs to, or None.

    Args:
        name: the tensor's name.

    Returns:
        The `e` of `.experts.<e>.` in the name, or None for every tensor that is not per-expert.
    """
    m = _EXPERT.search(name)
    return int(m[1]) if m is not None else None


def is_mtp(name: str) -> bool:
    """Whether a tensor belongs to the multi-token-prediction layers (Megatron builds them on the
    last pipeline stage)."""
    return _MTP.match(name) is not None


def split_dimension(name: str, shape: tuple[int, ...]) -> int | None:
    """The dimension tensor parallelism splits a (Hugging Face) tensor along (Megatron's
    `partition_dim`, vLLM's split), or None.

    Experts are judged like dense modules (their holders are the expert group); routers, norms,
    shared-expert gates and row-parallel biases are replicated.
    """
    module = naming.module_name(name)
    if _VOCAB.search(name):
        return 0
    if any(module.endswith(m) for m in (*_GDN_SECTIONED, *_GDN_HEADS)):
        return 0
    if _MTP_FC.match(module) and name.endswith(".weight") and len(shape) == 2:
        return 0
    proj = module.rsplit(".", 1)[-1]
    if name.endswith(".weight") and len(shape) == 2:
        return 0 if proj in _COLUMN_PARALLEL else 1 if proj in _ROW_PARALLEL else None
    if name.endswith(".bias") and len(shape) == 1 and proj in _COLUMN_PARALLEL:
        return 0  # a column-parallel layer's bias follows its rows; a row-parallel one is whole
    return None


def gdn_sections(name: str, shape: tuple[int, ...], shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The sections a GDN q/k/v projection or conv1d is split by, from its layer's in_proj_z.

    Args:
        name: the tensor's name.
        shape: its full shape.
        shapes: name -> full shape of every tensor of the model (to find the layer's in_proj_z,
            whose value_dim rows give the size of v).

    Returns:
        [key_dim, key_dim, value_dim] for a GDN q/k/v projection or conv1d; () for every other
        tensor. Raises ShardingError when the layer's in_proj_z is missing or does not fit.
    """
    module = naming.module_name(name)
    for suffix in _GDN_SECTIONED:
        if module.endswith(suffix):
            z = shapes.get(module[: -len(suffix)] + "linear_attn.in_proj_z.weight")
            if z is None or (shape[0] - z[0]) % 2 or shape[0] <= z[0]:
                raise ShardingError(name, "a split GDN q/k/v tensor needs its layer's linear_attn.in_proj_z "
                                    "(value_dim rows) to find its q, k and v sections")
            key_dim = (shape[0] - z[0]) // 2
            return (key_dim, key_dim, z[0])
    return ()
