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


_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def config_from_hf(config: dict[str, Any], where: str = "config.json") -> ReferenceModelConfig:
    """The reference model of a Qwen3 / Qwen3-MoE `config.json` (the embedded engine computes
    those two architectures only).

    Args:
        config: the parsed config.json.
        where: the file, for errors.

    Returns:
        The ReferenceModelConfig at the checkpoint's shapes.

    Raises:
        CheckpointError: another architecture, or a Qwen3 feature the reference model does not
            compute (attention biases, sliding windows, rope scaling, unnormalised top-k).
    """
    from domain.errors import CheckpointError

    model_type = config.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise CheckpointError(f"{where}: model_type {model_type!r}; the embedded reference engine computes qwen3 and "
                              "qwen3_moe only: run this model with --engine vllm")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    unsupported = [k for k, bad in (
        ("attention_bias", bool(config.get("attention_bias"))),
        ("use_sliding_window", bool(config.get("use_sliding_window"))),
        ("rope_parameters.rope_type", rope.get("rope_type", rope.get("type", "default")) != "default"),
        ("norm_topk_prob", model_type == "qwen3_moe" and not config.get("norm_topk_prob", False)),
        ("decoder_sparse_step", int(config.get("decoder_sparse_step", 1)) != 1),
    ) if bad]
    if unsupported:
        raise CheckpointError(f"{where}: {', '.join(unsupported)} is not computed by the embedded reference engine; "
                              "run this model with --engine vllm")
    heads = int(config["num_attention_heads"])
    moe = model_type == "qwen3_moe"
    try:
        return ReferenceModelConfig(
            vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
            num_layers=int(config["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            intermediate_size=int(config["intermediate_size"]),
            # transformers 5 writes num_local_experts; older configs (and vLLM's) num_experts
            num_experts=int(config.get("num_local_experts") or config["num_experts"]) if moe else 0,
            num_experts_per_tok=int(config.get("num_experts_per_tok", 2)) if moe else 2,
            moe_intermediate_size=int(config["moe_intermediate_size"]) if moe else 0,
            mlp_only_layers=tuple(config.get("mlp_only_layers") or ()) if moe else (),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 1_000_000.0))),
        )
    except KeyError as err:
        raise CheckpointError(f"{where}: has no {err.args[0]!r}; a {model_type} config needs it") from None
    except ValueError as err:
        raise CheckpointError(f"{where}: {err}") from None
