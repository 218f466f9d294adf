"""A Megatron-Core GPTModel with the embedded reference model's architecture, on the current
parallel layout.

The reference model (`adapters.reference.config.ReferenceModelConfig`) is a Qwen3-like decoder:
RMSNorm, q/k norms, SwiGLU, rotary embeddings, no biases, an untied head, dense or MoE layers.
`build_reference_gpt` builds the same architecture with megatron-core's local (non-Transformer-
Engine) layer specs, so that its Hugging Face export (`adapters.megatron.hf_names`) has exactly
the reference engine's tensors: `refit demo megatron` refits a real, sharded Megatron
trainer into the reference engine.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from adapters.reference.config import ReferenceModelConfig
from domain.refit.topology import ParallelLayout


def gpt_config(cfg: ReferenceModelConfig, layout: ParallelLayout, **overrides: Any) -> Any:
    """The TransformerConfig of the reference architecture on `layout`.

    Args:
        cfg: the reference model's shapes.
        layout: tp / pp / ep / etp (the config carries them: Megatron counts layers per stage
            from it).
        overrides: extra TransformerConfig fields.

    Returns:
        A megatron.core TransformerConfig (float32 parameters, CPU initialization).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe: dict[str, Any] = {}
    if cfg.num_experts:
        moe = dict(
            num_moe_experts=cfg.num_experts, moe_ffn_hidden_size=cfg.moe_intermediate_size,
            moe_router_topk=cfg.num_experts_per_tok, moe_token_dispatcher_type="allgather",
            moe_layer_freq=[0 if i in cfg.mlp_only_layers else 1 for i in range(cfg.num_layers)],
            moe_router_pre_softmax=True,
        )
    return TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads,
        num_query_groups=cfg.num_kv_heads, kv_channels=cfg.head_dim, ffn_hidden_size=cfg.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps, qk_layernorm=True, add_bias_linear=False,
        gated_linear_unit=True, activation_func=F.silu, init_method_std=cfg.init_std, use_cpu_initialization=True,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
        pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0, **moe, **overrides,
    )


def build_reference_gpt(cfg: ReferenceModelConfig, layout: ParallelLayout, *, seed: int = 0,
                        max_sequence_length: int = 256, tied: bool = False, **overrides: Any) -> torch.nn.Module:
    """This rank's GPTModel of the reference architecture (inside `megatron_on_cpu()` on CPU).

    Args:
        cfg: the reference model's shapes.
        layout: the parallel layout parallel_state was initialized with.
        seed: torch seed for the initialization.
        max_sequence_length: the longest sequence it scores.
        tied: share the embedding and the output layer (the reference engine's model is untied:
            a tied model refits into engines of its own layout).
        overrides: extra TransformerConfig fields.

    Returns:
        The model of this rank's stage (pre_process / post_process set from parallel_state).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(seed)
    config = gpt_config(cfg, layout, **overrides)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
        max_sequence_length=max_sequence_length, position_embedding_type="rope", rotary_base=int(cfg.rope_theta),
        share_embeddings_and_output_weights=tied, pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
