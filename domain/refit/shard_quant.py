"""The math of a sharded export: per-rank amax, the global scale from its all-reduced maximum,
quantizing a shard, and joining the TP ranks' pieces into the single-process checkpoint tensors.

Every function is pure; the collectives that move amax values and pieces between ranks live in
the transport adapter. Together they make a TP-split export bit-identical to `quantize_stream` on
the full tensors (tests/unit/test_sharding.py checks it for every preset).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from domain.errors import ShardingError
from domain.quant import modelopt_layout, naming
from domain.quant.formats import ElementRule
from domain.quant.plan import QuantizationPlan, TensorDecision
from domain.refit.buckets import align_up

_PIECE_ALIGN = 16  # byte alignment of each tensor inside a flattened piece (any dtype's view)


def local_amax(shards: Iterable[torch.Tensor]) -> torch.Tensor:
    """The largest |x| over one rank's shards of a unit, as float32 (0 when it holds none).

    Args:
        shards: the rank's shards of every member (2-D).

    Returns:
        A float32 scalar tensor. The maximum over ranks of these values is exactly the amax of
        the full tensors (a maximum only selects, it never rounds).
    """
    amax = torch.zeros((), dtype=torch.float32)
    for t in shards:
        amax = torch.maximum(amax, t.detach().abs().amax().float())
    return amax


def global_scale_from_amax(
    amax: torch.Tensor, name: str, numerics: ElementRule = ElementRule.ENGINE
) -> torch.Tensor:
    """The NVFP4 global scale for a unit whose amax (over every rank) is `amax`.

    Args:
        amax: float32 scalar, the all-reduced maximum of `local_amax` over the unit's holders.
        name: the unit's name, for errors.
        numerics: the plan's element rule.

    Returns:
        float32 [1]: the codecs' own `nvfp4_global_scale` applied to that maximum, hence the value a
        single process computes over the full tensors. Raises NonFiniteTensor for NaN/Inf.
    """
    from domain.quant.codecs import nvfp4_global_scale

    return nvfp4_global_scale(amax.reshape(1, 1).float(), name=name, numerics=numerics)


def quantize_shard(
    plan: QuantizationPlan, decision: TensorDecision, shard: torch.Tensor, global_scale: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """One rank's piece of a tensor in checkpoint format (local names, e.g. `weight_packed`).

    Args:
        plan: the quantization plan (element and MX scale rules).
        decision: the tensor's decision (BF16 passes the shard through as `weight`).
        shard: the rank's shard (2-D), or the gathered full tensor.
        global_scale: NVFP4: the unit's global scale from `global_scale_from_amax`; else None.

    Returns:
        Local checkpoint name -> tensor.
    """
    if not decision.is_quantized:
        return {"weight": shard}
    from domain.quant.codecs import quantize_weight

    gs = global_scale if decision.format.has_global_scale else None
    q = quantize_weight(decision.format, shard, name=decision.name, global_scale=gs, numerics=plan.numerics,
                        scale_rule=plan.scale_rule)
    return dict(q.tensors)


def concat_shards(pieces: Sequence[Mapping[str, torch.Tensor]], dim: int, name: str,
                  sections: Sequence[int] = ()) -> dict[str, torch.Tensor]:
    """Join the TP ranks' pieces of one tensor (in TP-rank order) into the full checkpoint tensors.

    Args:
        pieces: each rank's `quantize_shard` output; all have the same keys.
        dim: the split dimension (weights and block scales are split along the same one).
        name: the tensor's name, for errors.
        sections: the placement's sections (`Placement.sections`): each piece holds its share of
            every section in turn, and the full tensor is section after section; () = one.

    Returns:
        Local checkpoint name -> full tensor. A global scale is the same on every piece (it came
        from one all-reduce) and is kept once; a difference raises ShardingError.
    """
    out: dict[str, torch.Tensor] = {}
    for key in pieces[0]:
        parts = [p[key] for p in pieces]
        if key == "weight_global_scale":
            if any(not torch.equal(parts[0], p) for p in parts[1:]):
                raise ShardingError(name, "TP ranks quantized with different global scales; their amax all-reduce diverged")
            out[key] = parts[0]
        elif sections:
            chunks = [p.split([s // len(parts) for s in sections], dim=dim) for p in parts]
            out[key] = torch.cat([c[i] for i in range(len(sections)) for c in chunks], dim=dim)
        else:
            out[key] = torch.cat(parts, dim=dim)
    return out


def checkpoint_items(
    plan: QuantizationPlan, decision: TensorDecision, tensors: Mapping[str, torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """Full checkpoint names for one tensor's local checkpoint tensors, as `quantize_stream` names them.

    Args:
        plan: the quantization plan (name of the block scale).
        decision: the tensor's decision.
        tensors: local name -> tensor.

    Returns:
        (name, tensor) pairs in the codec's order.
    """
    if not decision.is_quantized:
        return [(decision.name, tensors["weight"])]
    module = naming.module_name(decision.name)
    if plan.expert_layout == "modelopt" and decision.format.name == "NVFP4" and naming.experts_layer(module):
        return [(f"{module}.{k}", t) for k, t in modelopt_layout.modelopt_tensors(tensors).items()]
    return [(f"{module}.{plan.scale_name if k == 'weight_scale' else k}", t) for k, t in tensors.items()]


def piece_nbytes(piece: Mapping[str, torch.Tensor]) -> int:
    """Bytes `flatten_piece` makes of a piece (each tensor 16-byte aligned)."""
    end = 0
    for t in piece.values():
        end = align_up(end + t.numel() * t.element_size(), _PIECE_ALIGN)
    return end


def flatten_piece(piece: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """One flat uint8 buffer holding a piece's tensors, each at a 16-byte-aligned offset."""
    sizes = [t.numel() * t.element_size() for t in piece.values()]
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end = align_up(end + n, _PIECE_ALIGN)
    flat = torch.zeros(end, dtype=torch.uint8)
    for (_, t), off, n in zip(piece.items(), offsets, sizes, strict=True):
        flat[off : off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return flat


def unflatten_piece(flat: torch.Tensor, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views of a `flatten_piece` buffer with the names, shapes and dtypes of `like`."""
    out, off = {}, 0
    for key, t in like.items():
        n = t.numel() * t.element_size()
        out[key] = flat[off : off + n].view(t.dtype).view(t.shape)
        off = align_up(off + n, _PIECE_ALIGN)
    return out
