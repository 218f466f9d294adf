"""An engine's own tensor parallelism: which part of each checkpoint tensor an engine rank keeps.

The refit stream carries full checkpoint tensors; an engine sharded over `tp` ranks (vLLM's
`tensor_parallel_size`) receives the same stream on every rank and keeps, like vLLM's
weight loaders, rank r's share of each split weight: column-parallel weights (q/k/v, gate/up,
embeddings, LM head, every expert's gate/up) by rows, row-parallel ones (o_proj, down_proj,
every expert's down_proj) by columns; norms, routers and global scales whole. The split of a
quantized tensor follows its elements: the elements' rows or columns (FP4's packed bytes), the
block scales' rows or columns of blocks; a share that does not cover whole blocks cannot be
served and is refused, naming the tensor (vLLM refuses it too).
"""

from __future__ import annotations

import torch

from domain.errors import ShardingError
from domain.refit.split_rules import split_dimension

GLOBAL_SCALE = "weight_global_scale"


def engine_split_dim(hf_name: str, shape: tuple[int, ...]) -> int | None:
    """The dimension an engine's tensor parallelism splits a (Hugging Face) tensor along.

    Args:
        hf_name: the tensor's name (`model.layers.0.self_attn.q_proj.weight`).
        shape: its full shape.

    Returns:
        0 (rows), 1 (columns) or None (kept whole on every rank).
    """
    return split_dimension(hf_name, tuple(shape))


def engine_shard(local: str, tensor: torch.Tensor, hf_name: str, hf_shape: tuple[int, ...], tp: int,
                 rank: int) -> torch.Tensor:
    """Engine rank `rank`'s share of one checkpoint tensor (a view).

    Args:
        local: which of the tensor's checkpoint tensors it is: `weight`, `weight_packed`, the
            block scale (`weight_scale` / `weight_scale_inv`) or `weight_global_scale`.
        tensor: the full checkpoint tensor.
        hf_name: the Hugging Face tensor it encodes (its split follows that tensor's).
        hf_shape: that tensor's full shape.
        tp: the engine's tensor-parallel size.
        rank: this engine rank.

    Returns:
        The rank's share. Raises ShardingError naming the tensor when tp does not split it into
        whole shares (of elements, of packed bytes, of scale blocks).
    """
    dim = engine_split_dim(hf_name, hf_shape)
    if tp == 1 or dim is None or local == GLOBAL_SCALE:
        return tensor
    extent = tensor.shape[dim]
    if extent % tp:
        what = "blocks" if local not in ("weight", "weight_packed") else "elements"
        raise ShardingError(f"{hf_name} ({local})", f"an engine tensor-parallel size of {tp} does not split its {extent} "
                            f"{what} along dimension {dim} into whole shares; serve the module in BF16 or use a smaller tp")
    step = extent // tp
    return tensor.narrow(dim, rank * step, step)
