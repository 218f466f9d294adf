"""Megatron-Core GPT parameter names -> Hugging Face names, for dense and MoE models on one rank.

Megatron fuses q/k/v into `linear_qkv` (grouped per query group: the group's query heads, then
one key head, then one value head) and gate/up into `linear_fc1` ([gate; up] when the MLP is
gated). Both local and Transformer Engine layer specs are understood (TE keeps the layer norms
inside the following linear as `layer_norm_weight` / `layer_norm_bias`).

MoE layers (Qwen3-MoE / Qwen2-MoE / DeepSeek naming on the Hugging Face side):

| Megatron (inside `decoder.layers.N.`) | Hugging Face (inside `model.layers.N.`) |
|---|---|
| `mlp.router.weight` | `mlp.gate.weight` |
| `mlp.router.expert_bias` | `mlp.gate.e_score_correction_bias` |
| `mlp.experts.local_experts.E.linear_fc1.weight` (SequentialMLP) | `mlp.experts.E.gate_proj.weight`, `mlp.experts.E.up_proj.weight` |
| `mlp.experts.linear_fc1.weightE` (TEGroupedMLP) | the same |
| `mlp.experts.local_experts.E.linear_fc2.weight`, `mlp.experts.linear_fc2.weightE` | `mlp.experts.E.down_proj.weight` |
| `mlp.shared_experts.linear_fc1.weight` / `linear_fc2.weight` | `mlp.shared_expert.gate_proj` + `up_proj` / `down_proj` |
| `mlp.shared_experts.gate_weight` | `mlp.shared_expert_gate.weight` |

Expert indices are the rank's local ones: with expert parallelism above 1 they are not the
model's, so callers reject it. The legacy GroupedMLP (`experts.weight1` / `weight2`, all experts
in one transposed tensor) is not mapped.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from domain.errors import MegatronModelUnsupported

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

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


def split_qkv(fused: torch.Tensor, config: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split Megatron's grouped `linear_qkv` weight [groups*(heads/group+2)*d, H] (or bias).

    Args:
        fused: the fused weight (2-D) or bias (1-D).
        config: the TransformerConfig (num_attention_heads, num_query_groups, kv_channels).

    Returns:
        (q, k, v) with rows [heads*d], [groups*d], [groups*d].
    """
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    d = config.kv_channels
    per = heads // groups
    t = fused.reshape(groups, per + 2, d, *fused.shape[1:])
    q = t[:, :per].reshape(heads * d, *fused.shape[1:])
    k = t[:, per].reshape(groups * d, *fused.shape[1:])
    v = t[:, per + 1].reshape(groups * d, *fused.shape[1:])
    return q, k, v


def hf_named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every parameter of an unwrapped GPTModel on one rank, in order.

    Args:
        model: the real GPTModel (tp = pp = 1).

    Returns:
        An iterator; `lm_head.weight` only when the output layer is not tied.
    """
    config: Any = model.config
    for name, tensor in model.state_dict(keep_vars=False).items():
        if name.endswith("_extra_state"):
            continue
        if name in _TOP_NAMES:
            yield _TOP_NAMES[name], tensor
            continue
        m = _LAYER.match(name)
        if m is None:
            raise MegatronModelUnsupported(f"parameter {name!r} has no Hugging Face name in this adapter")
        layer, suffix = m.groups()
        prefix = f"model.layers.{layer}."
        expert = _EXPERT.match(suffix)
        if suffix in _LAYER_NAMES:
            yield prefix + _LAYER_NAMES[suffix], tensor
        elif suffix.startswith("self_attention.linear_qkv."):
            kind = suffix.rsplit(".", 1)[1]
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), split_qkv(tensor, config), strict=True):
                yield f"{prefix}self_attn.{proj}.{kind}", part
        elif suffix.startswith("mlp.linear_fc1."):
            yield from _fc1(f"{prefix}mlp.", suffix.rsplit(".", 1)[1], tensor, config)
        elif suffix.startswith("mlp.shared_experts.linear_fc1."):
            yield from _fc1(f"{prefix}mlp.shared_expert.", suffix.rsplit(".", 1)[1], tensor, config)
        elif expert is not None:
            index, fc, kind = (expert[1], expert[2], expert[3]) if expert[1] is not None else (expert[6], expert[4], expert[5])
            module = f"{prefix}mlp.experts.{int(index)}."
            if fc == "linear_fc1":
                yield from _fc1(module, kind, tensor, config)
            else:
                yield f"{module}down_proj.{kind}", tensor
        else:
            raise MegatronModelUnsupported(
                f"parameter {name!r} has no Hugging Face name in this adapter (dense and MoE GPT layers are "
                "mapped; the legacy GroupedMLP and other layer types are not)"
            )


def _fc1(module: str, kind: str, tensor: torch.Tensor, config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """A `linear_fc1` weight or bias: [gate; up] when the MLP is gated, else up alone."""
    if config.gated_linear_unit:
        gate, up = tensor.chunk(2, dim=0)
        yield f"{module}gate_proj.{kind}", gate
        yield f"{module}up_proj.{kind}", up
    else:
        yield f"{module}up_proj.{kind}", tensor
