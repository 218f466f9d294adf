"""A sharded Megatron-Core model's global weights, through Megatron's own checkpoint metadata.

`megatron_pieces(model)` describes every tensor a rank holds as Megatron's distributed
checkpointing does (`sharded_state_dict`: the global key, the global shape, this piece's offset;
one main replica of each piece); `load_global(model, pieces)` writes the pieces of every rank into
a model of any layout (tp = pp = ep = 1 in one process, typically). Nothing here knows Hugging
Face names or how q/k/v are grouped: it is Megatron's description of its own layout, so the
unsharded model it gives is an independent reference for the sharded refit (`refit demo
megatron` judges every refit against its export; the tests do too).
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

Piece = tuple[str, tuple[int, ...], tuple[int, ...], int, bytes]  # key, global shape, offset, prepended axes, data


def _pack(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t.detach().contiguous().clone(), buf)
    return buf.getvalue()


def _unpack(data: bytes) -> torch.Tensor:
    return torch.load(io.BytesIO(data))


def _sharded_tensors(model: Any) -> Iterator[Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for value in model.sharded_state_dict().values():
        built = value.build() if isinstance(value, ShardedTensorFactory) else value
        items = built.values() if isinstance(built, dict) else built if isinstance(built, list | tuple) else [built]
        yield from (sh for sh in items if isinstance(sh, ShardedTensor))


def _index(offset: Sequence[int], shape: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))


def megatron_pieces(model: Any) -> list[Piece]:
    """This rank's main-replica pieces, as plain data (picklable across processes).

    Args:
        model: this rank's real GPTModel.

    Returns:
        (global key, global shape, offset, prepended axes, serialized tensor) per piece.
    """
    return [(sh.key, tuple(sh.global_shape), tuple(sh.global_offset), sh.prepend_axis_num, _pack(sh.data))
            for sh in _sharded_tensors(model) if not any(sh.replica_id)]


def global_tensors(pieces: Iterable[Piece]) -> dict[str, torch.Tensor]:
    """Megatron's global checkpoint tensors from every rank's pieces.

    Raises:
        ValueError: a tensor is not covered by the pieces (a rank's pieces are missing).
    """
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for key, shape, offset, prepend, data in pieces:
        t = _unpack(data)
        whole = out.setdefault(key, torch.zeros(shape, dtype=t.dtype))
        mask = covered.setdefault(key, torch.zeros(shape, dtype=torch.bool))
        local = (1,) * prepend + tuple(t.shape)
        whole[_index(offset, local)] = t.reshape(local)
        mask[_index(offset, local)] = True
    holes = [k for k, m in covered.items() if not bool(m.all())]
    if holes:
        raise ValueError(f"the pieces do not cover {len(holes)} tensors, e.g. {holes[:3]}; pass every rank's pieces")
    return out


def load_global(model: Any, pieces: Iterable[Piece]) -> None:
    """Write the global weights into `model` (any layout: each tensor takes its own piece).

    Raises:
        ValueError: the pieces and the model do not hold the same tensors.
    """
    whole = global_tensors(pieces)
    loaded = set()
    with torch.no_grad():
        for sh in _sharded_tensors(model):
            if sh.key not in whole:
                raise ValueError(f"the model has {sh.key!r}, which the pieces lack; build the same model")
            local = (1,) * sh.prepend_axis_num + tuple(sh.data.shape)
            sh.data.copy_(whole[sh.key][_index(sh.global_offset, local)].reshape(sh.data.shape))
            loaded.add(sh.key)
    if loaded != set(whole):
        raise ValueError(f"the pieces hold tensors the model lacks: {sorted(set(whole) - loaded)[:3]}")
