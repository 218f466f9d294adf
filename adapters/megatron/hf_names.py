"""Megatron-Core GPT parameter names -> Hugging Face names, for dense, MoE and hybrid
(GatedDeltaNet + attention, multi-token prediction) models, on one rank or one shard.

Megatron fuses q/k/v into `linear_qkv` (grouped per query group: the group's query heads, with
an output gate their gate heads, then one key head, then one value head), gate/up into
`linear_fc1` ([gate; up] when the MLP is gated), and a GatedDeltaNet's projections into
`in_proj` ([q; k; v; z; beta; alpha]). Both local and Transformer Engine layer specs are
understood (TE keeps the layer norms inside the following linear as `layer_norm_weight` /
`layer_norm_bias`).

| Megatron (inside `decoder.layers.N.`) | Hugging Face (inside `model.layers.N.`) |
|---|---|
| `self_attention.linear_qkv.weight` | `self_attn.q_proj` (with `attention_output_gate`: [q_h; gate_h] per head, Qwen3.5), `k_proj`, `v_proj` |
| `self_attention.linear_proj.weight` | `self_attn.o_proj.weight` |
| `self_attention.q_layernorm` / `k_layernorm` | `self_attn.q_norm` / `k_norm` |
| `self_attention.in_proj.weight` (GatedDeltaNet) | `linear_attn.in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` |
| `self_attention.conv1d.weight` / `.bias`, `A_log`, `dt_bias` | `linear_attn.conv1d.weight` / `.bias`, `linear_attn.A_log`, `linear_attn.dt_bias` |
| `self_attention.out_norm.weight`, `self_attention.out_proj.weight` | `linear_attn.norm.weight`, `linear_attn.out_proj.weight` |
| `mlp.router.weight` | `mlp.gate.weight` |
| `mlp.router.expert_bias` | `mlp.gate.e_score_correction_bias` |
| `mlp.experts.local_experts.E.linear_fc1.weight` (SequentialMLP) | `mlp.experts.E.gate_proj.weight`, `mlp.experts.E.up_proj.weight` |
| `mlp.experts.linear_fc1.weightE` (TEGroupedMLP) | the same |
| `mlp.experts.local_experts.E.linear_fc2.weight`, `mlp.experts.linear_fc2.weightE` | `mlp.experts.E.down_proj.weight` |
| `mlp.shared_experts.linear_fc1.weight` / `linear_fc2.weight` | `mlp.shared_expert.gate_proj` + `up_proj` / `down_proj` |
| `mlp.shared_experts.gate_weight` | `mlp.shared_expert_gate.weight` |

Multi-token prediction (`mtp.layers.K.`, Qwen3.5 / Qwen3-Next naming on the Hugging Face side):
`enorm` -> `mtp.pre_fc_norm_embedding`, `hnorm` -> `mtp.pre_fc_norm_hidden`, `eh_proj` ->
`mtp.fc`, `final_layernorm` -> `mtp.norm`, and the inner layer `mtp_model_layer.*` (older
Megatron: `transformer_layer.*`) -> `mtp.layers.K.*` with the decoder-layer table above.

On a tensor-, pipeline- or expert-parallel rank the names are the full model's (each layer's
`layer_number`, each MoE layer's `local_expert_indices`) and the tensors are the rank's shards in
the Hugging Face layout: its query groups' q/k/v rows, its [gate; up] rows, its share of GDN's q,
k, v, z, b and a. Embedding copies that other stages own (a tied output layer on the last stage,
the MTP block's embedding) are left out. The legacy GroupedMLP (`experts.weight1` / `weight2`,
all experts in one transposed tensor) is not mapped.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from domain.errors import MegatronModelUnsupported

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_MTP_INNER = ("mtp_model_layer.", "transformer_layer.")

# (Megatron suffix inside a layer) -> (HF suffix inside `model.layers.N.`)
_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "input_layernorm.bias": "input_layernorm.bias",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.bias": "post_attention_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "post_attention_layernorm.bias",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.linear_fc2.bias": "mlp.down_proj.bias",
    # MoE: the router and the shared experts' single tensors
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_experts.linear_fc2.bias": "mlp.shared_expert.down_proj.bias",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
    # GatedDeltaNet (Megatron keeps it in the `self_attention` slot)
    "self_attention.in_proj.layer_norm_weight": "input_layernorm.weight",
    "self_attention.conv1d.weight": "linear_attn.conv1d.weight",
    "self_attention.conv1d.bias": "linear_attn.conv1d.bias",
    "self_attention.A_log": "linear_attn.A_log",
    "self_attention.dt_bias": "linear_attn.dt_bias",
    "self_attention.out_norm.weight": "linear_attn.norm.weight",
    "self_attention.out_proj.weight": "linear_attn.out_proj.weight",
}
# MoE experts: SequentialMLP (`local_experts.E.linear_fcK.weight`) or TEGroupedMLP (`linear_fcK.weightE`).
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)|(linear_fc[12])\.(weight|bias)(\d+))$")
_TOP_NAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "embedding.position_embeddings.weight": "model.embed_positions.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "decoder.final_layernorm.bias": "model.norm.bias",
    "output_layer.weight": "lm_head.weight",
}
# The MTP block's own tensors (Megatron suffix inside `mtp.layers.K.`) -> HF name (K = 0).
_MTP_NAMES = {
    "enorm.weight": "mtp.pre_fc_norm_embedding.weight",
    "hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
    "eh_proj.weight": "mtp.fc.weight",
    "final_layernorm.weight": "mtp.norm.weight",
}


def _query_heads_per_group(config: Any) -> int:
    heads = config.num_attention_heads
    return heads // (config.num_query_groups or heads)


def split_qkv(fused: torch.Tensor, config: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split Megatron's grouped `linear_qkv` weight [groups*(heads/group+2)*d, H] (or bias, or a
    TP rank's shard of it: its own query groups).

    With `config.attention_output_gate` every group also holds its heads' gates after its query
    heads ([q heads; gate heads; k; v]); the Hugging Face q_proj then interleaves them per head
    ([q_h; gate_h], Qwen3.5's layout).

    Args:
        fused: the fused weight (2-D) or bias (1-D).
        config: the TransformerConfig (num_attention_heads, num_query_groups, kv_channels,
            attention_output_gate).

    Returns:
        (q, k, v); q has rows [heads*d] ([2*heads*d] with the gate), k and v [groups*d].
    """
    per, d = _query_heads_per_group(config), config.kv_channels
    gated = bool(getattr(config, "attention_output_gate", False))
    rows = (2 * per + 2 if gated else per + 2) * d
    if fused.shape[0] % rows:
        raise MegatronModelUnsupported(
            f"linear_qkv has {fused.shape[0]} rows, not a whole number of query groups of {rows}; "
            "with num_query_groups below the tensor-parallel size a rank holds part of a group: use "
            "a tensor-parallel size that divides num_query_groups"
        )
    groups = fused.shape[0] // rows
    tail = fused.shape[1:]
    t = fused.reshape(groups, rows // d, d, *tail)
    if gated:
        q = t[:, :per].reshape(groups * per, 1, d, *tail)
        gate = t[:, per : 2 * per].reshape(groups * per, 1, d, *tail)
        q = torch.cat([q, gate], dim=1).reshape(2 * groups * per * d, *tail)  # [q_h; gate_h] per head
        k, v = t[:, 2 * per], t[:, 2 * per + 1]
    else:
        q = t[:, :per].reshape(groups * per * d, *tail)
        k, v = t[:, per], t[:, per + 1]
    return q, k.reshape(groups * d, *tail), v.reshape(groups * d, *tail)


def split_gdn_in_proj(fused: torch.Tensor, config: Any) -> dict[str, torch.Tensor]:
    """Split a GatedDeltaNet `in_proj` weight [q; k; v; z; beta; alpha] (or a TP rank's shard of
    it: its share of each) into the Hugging Face projections.

    Args:
        fused: the weight, [2*key_dim + 2*value_dim + 2*value_heads, H] over the TP size.
        config: the TransformerConfig (linear_num_key_heads, linear_key_head_dim,
            linear_num_value_heads, linear_value_head_dim).

    Returns:
        `in_proj_qkv` ([q; k; v], the conv1d channels), `in_proj_z`, `in_proj_b`, `in_proj_a`.
    """
    qk = config.linear_num_key_heads * config.linear_key_head_dim
    v = config.linear_num_value_heads * config.linear_value_head_dim
    heads = config.linear_num_value_heads
    full = 2 * qk + 2 * v + 2 * heads
    if full % fused.shape[0] or any(x % (full // fused.shape[0]) for x in (qk, v, heads)):
        raise MegatronModelUnsupported(
            f"GatedDeltaNet in_proj has {fused.shape[0]} rows, not a tensor-parallel share of {full}; "
            "use a tensor-parallel size that divides the key and value heads"
        )
    tp = full // fused.shape[0]
    q, k, val, z, b, a = fused.split([qk // tp, qk // tp, v // tp, v // tp, heads // tp, heads // tp], dim=0)
    return {"in_proj_qkv": torch.cat([q, k, val], dim=0), "in_proj_z": z, "in_proj_b": b, "in_proj_a": a}


def _indices(model: torch.nn.Module, attr: str) -> Mapping[int, Any]:
    """Local index -> module of the model's decoder layers (`decoder`) or MTP layers (`mtp`)."""
    block = getattr(model, attr, None)
    layers = getattr(block, "layers", None)
    return dict(enumerate(layers)) if isinstance(layers, torch.nn.ModuleList) else {}


def _layer_number(layers: Mapping[int, Any], local: int) -> int:
    """The global 0-based layer index of local decoder layer `local` (Megatron counts from 1)."""
    layer = layers.get(local)
    number = getattr(layer, "layer_number", None)
    return int(number) - 1 if isinstance(number, int) else local


def _expert_index(layer: Any, local: int) -> int:
    """The global index of local expert `local` of an MoE layer (its `local_expert_indices`)."""
    indices = getattr(getattr(layer, "mlp", None), "local_expert_indices", None)
    return int(indices[local]) if indices is not None else local


def _skipped(model: torch.nn.Module, name: str) -> bool:
    """Copies of tensors another stage exports: the embedding on a stage that is not the first
    (the MTP block's, or a tied output layer's), and a tied output layer."""
    if name.startswith("embedding.") and getattr(model, "pre_process", True) is False:
        return True
    return name == "output_layer.weight" and bool(getattr(model, "share_embeddings_and_output_weights", False))


def hf_named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every parameter of an unwrapped GPTModel on this rank, in order.

    Args:
        model: the real GPTModel (or anything with `config` and `state_dict()`).

    Returns:
        An iterator; `lm_head.weight` only when the output layer is not tied. On a sharded rank:
        the full model's names and this rank's shards (see the module docstring).
    """
    for hf, tensor, _ in hf_tensors(model):
        yield hf, tensor


def hf_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Like `hf_named_weights`, with the Megatron name each tensor comes from.

    Returns:
        (HF name, tensor, Megatron state-dict name) triples, in state-dict order.
    """
    for name, tensor in model.state_dict(keep_vars=False).items():
        if name.endswith("_extra_state") or not isinstance(tensor, torch.Tensor) or _skipped(model, name):
            continue
        for hf, part in hf_parts(model, name, tensor):
            yield hf, part, name


def hf_parts(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors of one Megatron tensor, from `tensor` (its current value, or
    that value in another dtype).

    Most parts are views of `tensor` (slices, chunks); q/k/v of several query groups, a gated
    q_proj and GDN's `in_proj_qkv` are new tensors: a reader that keeps them does not see later
    updates of the parameter and must derive them again (`MegatronShardedModel.local_weight`).

    Args:
        model: the real GPTModel the tensor belongs to (its config and layer numbering).
        name: the tensor's Megatron state-dict name.
        tensor: its value.

    Returns:
        (HF name, part) pairs; MegatronModelUnsupported for a tensor without a Hugging Face name.
    """
    config: Any = model.config
    if name in _TOP_NAMES:
        yield _TOP_NAMES[name], tensor
        return
    if (m := _LAYER.match(name)) is not None:
        decoder = _indices(model, "decoder")
        local, suffix = int(m[1]), m[2]
        yield from _layer(f"model.layers.{_layer_number(decoder, local)}.", suffix, tensor, config, decoder.get(local), name)
    elif (m := _MTP.match(name)) is not None:
        yield from _mtp(int(m[1]), m[2], tensor, config, _indices(model, "mtp").get(int(m[1])), name)
    else:
        raise MegatronModelUnsupported(f"parameter {name!r} has no Hugging Face name in this adapter")


def _mtp(k: int, suffix: str, tensor: torch.Tensor, config: Any, block: Any,
         name: str) -> Iterator[tuple[str, torch.Tensor]]:
    for inner in _MTP_INNER:
        if suffix.startswith(inner):
            layer = getattr(block, inner.rstrip("."), None)
            yield from _layer(f"mtp.layers.{k}.", suffix.removeprefix(inner), tensor, config, layer, name)
            return
    if suffix in _MTP_NAMES:
        if k:
            raise MegatronModelUnsupported(
                f"parameter {name!r}: Hugging Face names one MTP block (mtp.fc, mtp.norm, ...); "
                "models with mtp_num_layers > 1 are not mapped"
            )
        yield _MTP_NAMES[suffix], tensor
        return
    raise MegatronModelUnsupported(f"parameter {name!r} has no Hugging Face name in this adapter")


def _layer(prefix: str, suffix: str, tensor: torch.Tensor, config: Any, layer: Any,
           name: str) -> Iterator[tuple[str, torch.Tensor]]:
    expert = _EXPERT.match(suffix)
    if suffix in _LAYER_NAMES:
        yield prefix + _LAYER_NAMES[suffix], tensor
    elif suffix.startswith("self_attention.linear_qkv."):
        kind = suffix.rsplit(".", 1)[1]
        for proj, part in zip(("q_proj", "k_proj", "v_proj"), split_qkv(tensor, config), strict=True):
            yield f"{prefix}self_attn.{proj}.{kind}", part
    elif suffix == "self_attention.in_proj.weight":
        for proj, part in split_gdn_in_proj(tensor, config).items():
            yield f"{prefix}linear_attn.{proj}.weight", part
    elif suffix.startswith("mlp.linear_fc1."):
        yield from _fc1(f"{prefix}mlp.", suffix.rsplit(".", 1)[1], tensor, config)
    elif suffix.startswith("mlp.shared_experts.linear_fc1."):
        yield from _fc1(f"{prefix}mlp.shared_expert.", suffix.rsplit(".", 1)[1], tensor, config)
    elif expert is not None:
        index, fc, kind = (expert[1], expert[2], expert[3]) if expert[1] is not None else (expert[6], expert[4], expert[5])
        module = f"{prefix}mlp.experts.{_expert_index(layer, int(index))}."
        if fc == "linear_fc1":
            yield from _fc1(module, kind, tensor, config)
        else:
            yield f"{module}down_proj.{kind}", tensor
    else:
        raise MegatronModelUnsupported(
            f"parameter {name!r} has no Hugging Face name in this adapter (dense, MoE, GatedDeltaNet and "
            "MTP layers are mapped; the legacy GroupedMLP and other layer types are not)"
        )


def _fc1(module: str, kind: str, tensor: torch.Tensor, config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """A `linear_fc1` weight or bias: [gate; up] when the MLP is gated, else up alone (on a TP
    shard, [gate shard; up shard])."""
    if config.gated_linear_unit:
        gate, up = tensor.chunk(2, dim=0)
        yield f"{module}gate_proj.{kind}", gate
        yield f"{module}up_proj.{kind}", up
    else:
        yield f"{module}up_proj.{kind}", tensor
