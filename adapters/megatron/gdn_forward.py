"""The packed-aware forward of a Megatron-Core GatedDeltaNet layer (versions before 0.18).

Megatron-Core before 0.18 raises `NotImplementedError("GDN does not support packed sequence")`.
This forward runs the same computation as those versions' GDN forward (input projection,
causal conv on q/k/v, l2-normalized q/k, gated delta rule, gated RMSNorm, output projection)
with the packed boundaries threaded into the two sequence kernels, which come injected
(`GdnKernels`). It reads only attributes those versions and later ones both define.

Boundaries are validated once per batch, where the packed parameters are built
(`validate_packed_seq_params`: `adapters.megatron.thd.packed_seq_params` calls it with the host
integers it already has, and `app.services.packed_gdn` calls it at the model's entry for
parameters built elsewhere, e.g. by verl). The result rides on the PackedSeqParams object, so
`check_packed_input`, shared with the validation hook used on versions with native support,
reads nothing on the host: it checks Python integers and uses the boundary tensor as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog
import torch
import torch.nn.functional as F

from adapters.megatron.gdn_kernels import GdnKernels
from domain.errors import InvalidPackedBoundaries, PackedGdnUnsupported
from domain.forward.gdn_packing import (
    PackedBoundaries,
    build_seq_idx,
    check_boundary_tensor,
    check_boundary_values,
    full_sequence_length,
    reject_packed_deterministic,
    resolve_cu_seqlens,
)

log = structlog.get_logger()

# The attribute of a PackedSeqParams that carries its validated boundaries.
BOUNDARIES_ATTR = "_rl_refit_gdn_boundaries"


def is_packed(packed_seq_params: Any) -> bool:
    """True for THD packed-sequence parameters (Megatron's `PackedSeqParams`, qkv_format 'thd')."""
    return packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", "thd") == "thd"


def layer_label(layer: Any) -> str:
    number = getattr(layer, "layer_number", None)
    return f"{type(layer).__name__}(layer_number={number})" if number is not None else type(layer).__name__


def _kv_boundaries(packed_seq_params: Any) -> tuple[torch.Tensor | None, str]:
    kv_padded = getattr(packed_seq_params, "cu_seqlens_kv_padded", None)
    if kv_padded is not None:
        return kv_padded, "cu_seqlens_kv_padded"
    return getattr(packed_seq_params, "cu_seqlens_kv", None), "cu_seqlens_kv"


def validate_packed_seq_params(
    packed_seq_params: Any, *, cp_size: int = 1, values: Sequence[int] | None = None
) -> PackedBoundaries:
    """Validate a batch's packed boundaries once, where its PackedSeqParams is built.

    Checks the boundaries GDN layers use (padded ones first): an integer 1-D tensor starting at
    0, never decreasing, each length a multiple of the CP size; key/value boundaries, when given
    separately, equal the query ones. The record is attached to the PackedSeqParams, so every
    GDN layer of the batch checks it without a host read.

    Args:
        packed_seq_params: Megatron's PackedSeqParams (qkv_format 'thd').
        cp_size: context-parallel size.
        values: the boundaries' values when the caller holds them on the host already (a THD
            layout does); otherwise the tensor is read once, here.

    Returns:
        The PackedBoundaries. Raises InvalidPackedBoundaries.
    """
    cu_seqlens, name = resolve_cu_seqlens(
        getattr(packed_seq_params, "cu_seqlens_q_padded", None),
        getattr(packed_seq_params, "cu_seqlens_q", None),
    )
    check_boundary_tensor(cu_seqlens, name=name)
    host = tuple(int(v) for v in (cu_seqlens.tolist() if values is None else values))
    if len(host) != cu_seqlens.numel():
        raise InvalidPackedBoundaries(name, f"{len(host)} values given for a tensor of {cu_seqlens.numel()} boundaries",
                                      "pass the values the tensor was built from")
    check_boundary_values(host, name=name, cp_size=cp_size)
    kv, kv_name = _kv_boundaries(packed_seq_params)
    if kv is not None and kv is not cu_seqlens and not torch.equal(kv.to(cu_seqlens), cu_seqlens):
        raise InvalidPackedBoundaries(
            kv_name,
            f"differs from {name}; a GDN layer reads one sequence, so query and key/value boundaries must agree",
            f"pass the same boundaries as {name}",
        )
    record = PackedBoundaries(name, host, cu_seqlens)
    try:
        object.__setattr__(packed_seq_params, BOUNDARIES_ATTR, record)
    except (AttributeError, TypeError):  # a PackedSeqParams that takes no attribute: layers validate again
        log.warning("gdn.boundaries_not_attached", type=type(packed_seq_params).__name__)
    return record


def batch_boundaries(packed_seq_params: Any, *, cp_size: int = 1) -> PackedBoundaries:
    """The batch's validated boundaries: the attached record, or (parameters built without it,
    or whose boundary tensor was replaced since) a validation now, once for the batch.

    Args:
        packed_seq_params: Megatron's PackedSeqParams.
        cp_size: context-parallel size.

    Returns:
        The PackedBoundaries.
    """
    record = getattr(packed_seq_params, BOUNDARIES_ATTR, None)
    current, _ = resolve_cu_seqlens(
        getattr(packed_seq_params, "cu_seqlens_q_padded", None),
        getattr(packed_seq_params, "cu_seqlens_q", None),
    )
    if isinstance(record, PackedBoundaries) and record.tensor is current:
        return record
    return validate_packed_seq_params(packed_seq_params, cp_size=cp_size)


def check_packed_input(
    layer: Any, hidden_states: torch.Tensor, packed_seq_params: Any
) -> tuple[torch.Tensor, int]:
    """Check packed input for a GDN layer, without a host read once the batch is validated.

    Checks: batch dimension 1, deterministic mode off, and the batch's validated boundaries
    (`batch_boundaries`) against this layer: they end at local length x SP size x CP size, each
    length a multiple of the CP size. All on Python integers.

    Args:
        layer: the GatedDeltaNet module.
        hidden_states: `[s_local, b, h]` input of the layer.
        packed_seq_params: Megatron's PackedSeqParams.

    Returns:
        (cu_seqlens, total_length): the boundaries to use and the full packed length.
    """
    label = layer_label(layer)
    seq_local, batch = hidden_states.shape[0], hidden_states.shape[1]
    if batch != 1:
        raise PackedGdnUnsupported(
            f"{label}: packed (thd) input must have batch dimension 1, got hidden_states of shape "
            f"{tuple(hidden_states.shape)}; pack the micro-batch into one sequence"
        )
    reject_packed_deterministic(bool(getattr(layer.config, "deterministic_mode", False)), layer=label)
    cp_size = int(getattr(layer, "cp_size", 1))
    total = full_sequence_length(seq_local, int(getattr(layer, "sp_size", 1)), cp_size)
    record = batch_boundaries(packed_seq_params, cp_size=cp_size)
    check_boundary_values(record.values, total_length=total, name=record.name, cp_size=cp_size)
    return record.tensor, total


def packed_forward(
    layer: Any, hidden_states: torch.Tensor, packed_seq_params: Any, kernels: GdnKernels
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GDN forward over a packed batch; samples never see each other.

    Args:
        layer: a Megatron-Core GatedDeltaNet module.
        hidden_states: `[s_local, 1, hidden]`.
        packed_seq_params: PackedSeqParams with qkv_format 'thd'.
        kernels: the varlen kernels to call.

    Returns:
        (output, output_bias) as the layer's own forward returns them.
    """
    if int(getattr(layer, "cp_size", 1)) != 1:
        raise PackedGdnUnsupported(
            f"{layer_label(layer)}: the packed GDN forward of rl-refit does not run context parallelism "
            f"(context_parallel_size={layer.cp_size}); Megatron-Core >= 0.18 does it natively: upgrade, "
            "or set context_parallel_size=1"
        )
    cu_seqlens, total = check_packed_input(layer, hidden_states, packed_seq_params)
    seq_idx = build_seq_idx(cu_seqlens, total)
    batch, tp = 1, layer.tp_size
    qk_local, v_local, heads_local = layer.qk_dim // tp, layer.v_dim // tp, layer.num_value_heads // tp

    qkvzba, _ = layer.in_proj(hidden_states)
    # After the sequence-parallel gather the projection covers all `total` tokens.
    qkvzba = qkvzba.transpose(0, 1)
    qkv, gate, beta, alpha = torch.split(
        qkvzba, [2 * qk_local + v_local, v_local, heads_local, heads_local], dim=-1
    )
    gate = gate.reshape(batch, total, -1, layer.value_head_dim)
    beta = beta.reshape(batch, total, -1)
    alpha = alpha.reshape(batch, total, -1)

    qkv = kernels.conv(
        qkv.contiguous(),
        layer.conv1d.weight.squeeze(1),
        layer.conv1d.bias,
        layer.activation,
        cu_seqlens,
        seq_idx,
    )
    query, key, value = torch.split(qkv, [qk_local, qk_local, v_local], dim=-1)
    query = query.reshape(batch, total, -1, layer.key_head_dim)
    key = key.reshape(batch, total, -1, layer.key_head_dim)
    value = value.reshape(batch, total, -1, layer.value_head_dim)
    if layer.use_qk_l2norm:
        query = kernels.l2norm(query.contiguous())
        key = kernels.l2norm(key.contiguous())
    repeat = layer.num_value_heads // layer.num_key_heads
    if repeat > 1:
        query = query.repeat_interleave(repeat, dim=2)
        key = key.repeat_interleave(repeat, dim=2)

    # Contiguous before the elementwise gates, as upstream: CPU kernels round a strided tensor's
    # short rows on another path than a contiguous one.
    query, key, value, gate, beta, alpha = (t.contiguous() for t in (query, key, value, gate, beta, alpha))
    g = -layer.A_log.exp() * F.softplus(alpha.float() + layer.dt_bias)  # fp32, as upstream
    beta = beta.sigmoid()
    core = kernels.gated_delta_rule(query, key, value, g, beta, cu_seqlens)

    norm_out = layer._apply_gated_norm(core, gate)
    norm_out = norm_out.reshape(batch, total, -1).transpose(0, 1).contiguous()
    return layer.out_proj(norm_out)
