"""THD packing for Megatron-Core: recipe alignment from Megatron, `PackedSeqParams` from a layout.

The arithmetic lives in `domain.forward.thd`; this module asks Megatron-Core for the recipe alignment
(`get_fp8_align_size` / `get_fp4_align_size`) and builds its `PackedSeqParams`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

try:
    from megatron.core.packed_seq_params import PackedSeqParams
except ImportError as err:  # pragma: no cover - exercised only without megatron-core
    raise ModuleNotFoundError(
        "adapters.megatron.thd needs megatron-core (the `megatron` extra)", name="megatron.core"
    ) from err

from domain.forward.thd import ThdLayout, recipe_alignment, sequence_alignment


def _recipe_name(recipe: Any) -> str | None:
    return None if recipe is None else str(getattr(recipe, "value", recipe))


def megatron_recipe_alignment(config: Any) -> int:
    """Row alignment of the model's quantized training recipe (1 without one).

    Megatron-Core's `get_fp8_align_size` / `get_fp4_align_size` answer when they exist; the
    documented table (`domain.forward.thd.RECIPE_ALIGNMENT`) otherwise.

    Args:
        config: a TransformerConfig (reads fp8, fp8_recipe, fp4, fp4_recipe).

    Returns:
        The alignment in tokens.
    """
    if getattr(config, "fp8", None):
        name = _recipe_name(getattr(config, "fp8_recipe", None)) or "delayed"
        try:
            from megatron.core.enums import Fp8Recipe
            from megatron.core.fp8_utils import get_fp8_align_size
        except ImportError:
            return recipe_alignment(name)
        return int(get_fp8_align_size(Fp8Recipe(name)))
    if getattr(config, "fp4", None):
        name = _recipe_name(getattr(config, "fp4_recipe", None)) or "nvfp4"
        try:
            from megatron.core.enums import Fp4Recipe
            from megatron.core.fp4_utils import get_fp4_align_size
        except ImportError:
            return recipe_alignment(name)
        return int(get_fp4_align_size(Fp4Recipe(name)))
    return 1


def plan_packing(config: Any, seqlens: Sequence[int], *, tp: int = 1, cp: int = 1) -> ThdLayout:
    """The THD layout of `seqlens` for a model: alignment from its recipe, tp and cp.

    Args:
        config: the model's TransformerConfig.
        seqlens: real lengths of the sequences.
        tp: tensor-parallel size.
        cp: context-parallel size.

    Returns:
        The layout (total padded to a multiple of align * 128).
    """
    align = sequence_alignment(megatron_recipe_alignment(config), tp, cp)
    return ThdLayout.plan(seqlens, align=align)


def packed_seq_params(
    layout: ThdLayout, *, device: torch.device | str = "cpu", cp_group: Any = None
) -> PackedSeqParams:
    """Megatron's `PackedSeqParams` for a layout (qkv_format "thd").

    `cu_seqlens_q/kv` count real tokens, `cu_seqlens_q/kv_padded` are the slots in the pack;
    `max_seqlen_q/kv` is the longest padded slot; `total_tokens` is the packed total (where the
    installed Megatron-Core has the field, it derives `seq_idx` from it). The boundaries are
    validated here, once per batch, from the layout's host integers: GDN layers then read
    nothing on the host (`adapters.megatron.gdn_forward.validate_packed_seq_params`).

    Args:
        layout: the THD layout.
        device: where the int32 cu_seqlens tensors go.
        cp_group: the context-parallel group, when there is one.

    Returns:
        A PackedSeqParams.
    """
    cu = layout.cu_seqlens_tensor(padded=False, device=device)
    cu_padded = layout.cu_seqlens_tensor(padded=True, device=device)
    fields = dict(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=layout.max_seqlen,
        max_seqlen_kv=layout.max_seqlen,
        cp_group=cp_group,
        total_tokens=layout.total,
    )
    from adapters.megatron.gdn_forward import validate_packed_seq_params

    known = set(getattr(PackedSeqParams, "__dataclass_fields__", fields))
    params = PackedSeqParams(**{k: v for k, v in fields.items() if k in known})
    validate_packed_seq_params(params, values=layout.cu_seqlens_padded)
    return params
