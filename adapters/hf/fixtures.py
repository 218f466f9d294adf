"""Random Hugging Face checkpoints at real model shapes, written by transformers (no download):
a model built from its config with random weights, then `save_pretrained`.

The shapes are those of the released models' config.json; the weights are random (the refit, its
memory and its speed depend on shapes, not values). The tiny shapes keep the same structure
(tied head, q/k norms, grouped-query attention, experts) at a size tests can afford.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_QWEN3: dict[str, Any] = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
                          "attention_bias": False, "max_position_embeddings": 40960}

# name -> (model_type, config keys)
FIXTURES: dict[str, tuple[str, dict[str, Any]]] = {
    # Qwen/Qwen3-0.6B's shapes (0.6B parameters, tied head, 1.2 GB BF16)
    "qwen3-0.6b": ("qwen3", {**_QWEN3, "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
                             "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                             "head_dim": 128, "tie_word_embeddings": True}),
    # the same shapes untied (0.75B parameters, 1.43 GB BF16): issue 24's speed figures
    "qwen3-0.75b-untied": ("qwen3", {**_QWEN3, "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
                                     "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                                     "head_dim": 128, "tie_word_embeddings": False}),
    # a small Qwen3-MoE (Qwen3-30B-A3B's structure: 128-wide heads, q/k norms, top-8 of 32 experts)
    "qwen3-moe-small": ("qwen3_moe", {**_QWEN3, "vocab_size": 32768, "hidden_size": 1024, "intermediate_size": 3072,
                                      "moe_intermediate_size": 384, "num_hidden_layers": 4,
                                      "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
                                      "num_experts": 32, "num_experts_per_tok": 8, "norm_topk_prob": True,
                                      "decoder_sparse_step": 1, "mlp_only_layers": [],
                                      "tie_word_embeddings": False}),
    # the tests' shapes: the same structures, a few MiB (vLLM's CPU build serves both); q, k and v
    # are multiples of 128 rows, as FP8_BLOCK's fused modules need
    "tiny-qwen3": ("qwen3", {**_QWEN3, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "head_dim": 64, "max_position_embeddings": 4096, "tie_word_embeddings": True}),
    "tiny-qwen3-moe": ("qwen3_moe", {**_QWEN3, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
                                     "moe_intermediate_size": 128, "num_hidden_layers": 2,
                                     "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64,
                                     "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
                                     "decoder_sparse_step": 1, "mlp_only_layers": [],
                                     "max_position_embeddings": 4096, "tie_word_embeddings": True}),
}


def write_fixture(name: str, out: str | Path, *, seed: int = 0, max_shard_size: str = "500MB") -> Path:
    """Write the fixture `name` into `out` (config.json, safetensors shards, their index).

    Args:
        name: one of FIXTURES.
        out: the directory (created; files in it are replaced).
        seed: seed of the random weights.
        max_shard_size: `save_pretrained`'s shard size (real-size fixtures come in several shards).

    Returns:
        The directory.

    Raises:
        KeyError: naming the fixtures.
        ModuleNotFoundError: naming the adapter when transformers is missing.
    """
    if name not in FIXTURES:
        raise KeyError(f"unknown fixture {name!r}; valid: {', '.join(FIXTURES)}")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError("write_fixture needs transformers", name="transformers") from err
    model_type, keys = FIXTURES[name]
    config = AutoConfig.for_model(model_type, **keys)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    path = Path(out)
    model.save_pretrained(str(path), max_shard_size=max_shard_size)
    return path
