"""The embedded reference model as a Hugging Face checkpoint: a Qwen3 / Qwen3-MoE `config.json`
that transformers and the engines load, and a writer for the trainer's weights.

The reference model computes what Qwen3 (dense) and Qwen3-MoE compute: RMSNorm with q/k norms per
head, rotary embeddings (default rope), grouped-query attention without biases, SwiGLU MLPs,
softmax top-k routing with the top-k weights renormalised (`norm_topk_prob`), dense layers where
`mlp_only_layers` says, untied embeddings. An engine can therefore serve it (cold start from a
written checkpoint, or `load_format="dummy"` and a first refit).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from adapters.reference.config import ReferenceModelConfig
from adapters.reference.hf_config import config_from_hf

__all__ = ["MAX_POSITIONS", "config_from_hf", "hf_config", "write_checkpoint", "write_config"]

MAX_POSITIONS = 4096


def hf_config(cfg: ReferenceModelConfig) -> dict[str, Any]:
    """The `config.json` of the model (Qwen3ForCausalLM, or Qwen3MoeForCausalLM with experts).

    Args:
        cfg: the reference model's shapes.

    Returns:
        The config dict (no quantization_config: engines receive that separately).
    """
    out: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
        "initializer_range": cfg.init_std,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if cfg.num_experts:
        out.update({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": cfg.num_experts,
            "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(cfg.mlp_only_layers),
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        })
    return out


def write_config(cfg: ReferenceModelConfig, directory: str | Path, quantization_config: dict[str, Any] | None = None) -> Path:
    """Write `config.json` (and nothing else) into `directory`; returns the directory."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config = hf_config(cfg)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def write_checkpoint(cfg: ReferenceModelConfig, named_weights: Iterable[tuple[str, torch.Tensor]],
                     directory: str | Path) -> Path:
    """Write a BF16 checkpoint (config.json and one model.safetensors) of the given weights.

    Args:
        cfg: the model's shapes.
        named_weights: (Hugging Face name, tensor) pairs, e.g. `ReferenceTrainer.named_weights()`.
        directory: where to write (created).

    Returns:
        The directory.
    """
    from safetensors.torch import save_file

    path = write_config(cfg, directory)
    tensors = {name: t.detach().contiguous().clone() for name, t in named_weights}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
