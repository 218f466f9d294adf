"""A Qwen3 / Qwen3-MoE `config.json` read into the reference model's shapes, every field used
checked before anything is built (docs/your-model.md, docs/errors.md#checkpointerror).

Each field gets a type check (an integer where the model needs one: no `128.5`, no `"128"`, no
`null`, no `true`) and a range check. With the checkpoint's tensors at hand, the bounds follow from
them: the layer and expert counts may not exceed the layers and experts whose tensors are there,
and every tensor the shapes call for must be present at that shape, so that a config.json saying
`num_hidden_layers: 1000000000` is refused at once instead of building a model for ever.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from adapters.reference.config import ReferenceModelConfig, hf_weight_shapes
from domain.errors import CheckpointError

if TYPE_CHECKING:
    from adapters.hf_checkpoint.reader import HfCheckpoint

_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# No dimension of a tensor a safetensors header can describe and torch can index is larger.
MAX_DIM = 2**31 - 1
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")
LM_HEAD = "lm_head.weight"


def _integer(config: Mapping[str, Any], key: str, where: str, *, low: int = 1, high: int = MAX_DIM,
             default: int | None = None, nullable: bool = False) -> int:
    value = config.get(key, default)
    if value is None and nullable:
        value = default
    if value is None and key in config:
        fix = f"leave the key out (default {default})" if default is not None else "give the integer"
        raise CheckpointError(f"{where}: {key} is null; it must be an integer: {fix}")
    if value is None:
        raise CheckpointError(f"{where}: has no {key!r} (an integer); a Qwen3 config needs it")
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(f"{where}: {key} is {value!r}; it must be an integer")
    if not low <= value <= high:
        raise CheckpointError(f"{where}: {key} is {value}; it must be in [{low}, {high}]")
    return value


def _number(config: Mapping[str, Any], key: str, where: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CheckpointError(f"{where}: {key} is {value!r}; it must be a number")
    if not (math.isfinite(value) and value > 0):
        raise CheckpointError(f"{where}: {key} is {value!r}; it must be a finite number > 0")
    return float(value)


def _flag(config: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"{where}: {key} is {value!r}; it must be true or false")
    return value


def _rope(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    for key in ("rope_parameters", "rope_scaling"):
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise CheckpointError(f"{where}: {key} is {value!r}; it must be an object such as "
                                  '{"rope_type": "default", "rope_theta": 1000000.0}')
        return value
    return {}


def ties_head(config: Mapping[str, Any], where: str = "config.json") -> bool:
    """`tie_word_embeddings` of a Qwen3 config.json (false when absent, Qwen3's default)."""
    return _flag(config, "tie_word_embeddings", where, False)


def _unsupported(config: Mapping[str, Any], where: str, moe: bool, rope: dict[str, Any]) -> None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if not isinstance(rope_type, str):
        raise CheckpointError(f"{where}: rope_parameters.rope_type is {rope_type!r}; it must be a string")
    unsupported = [k for k, bad in (
        ("attention_bias", _flag(config, "attention_bias", where, False)),
        ("use_sliding_window", _flag(config, "use_sliding_window", where, False)),
        ("rope_parameters.rope_type", rope_type != "default"),
        ("norm_topk_prob", moe and not _flag(config, "norm_topk_prob", where, False)),
        ("decoder_sparse_step", moe and _integer(config, "decoder_sparse_step", where, default=1) != 1),
    ) if bad]
    if unsupported:
        raise CheckpointError(f"{where}: {', '.join(unsupported)} is not computed by the embedded reference engine; "
                              "run this model on vLLM (refit demo vllm)")


def _held(tensors: Mapping[str, tuple[int, ...]] | None, pattern: re.Pattern[str]) -> int:
    if tensors is None:
        return MAX_DIM
    found = [int(m.group(1)) for name in tensors if (m := pattern.match(name))]
    return max(found) + 1 if found else 0


def config_from_hf(config: Mapping[str, Any], where: str = "config.json",
                   tensors: Mapping[str, tuple[int, ...]] | None = None) -> ReferenceModelConfig:
    """The reference model of a Qwen3 / Qwen3-MoE `config.json` (the embedded engine computes
    those two architectures only), every field used checked first.

    Args:
        config: the parsed config.json.
        where: the file, for errors.
        tensors: the checkpoint's tensors (Hugging Face name -> shape), or None: with them, the
            layer and expert counts are bounded by what the tensors hold, and every tensor the
            shapes call for must be there at that shape (`lm_head.weight` only when untied).

    Returns:
        The ReferenceModelConfig at the checkpoint's shapes.

    Raises:
        CheckpointError: naming the key: another architecture, a Qwen3 feature the reference model
            does not compute (attention biases, sliding windows, rope scaling, unnormalised top-k),
            a value of the wrong type or out of range, or shapes the tensors do not have.
    """
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in _ARCHITECTURES:
        raise CheckpointError(f"{where}: model_type {model_type!r}; the embedded reference engine computes qwen3 and "
                              "qwen3_moe only: run this model on vLLM (refit demo vllm)")
    moe = model_type == "qwen3_moe"
    rope = _rope(config, where)
    _unsupported(config, where, moe, rope)
    layers = _integer(config, "num_hidden_layers", where)
    held = _held(tensors, _LAYER)
    if layers > held:
        raise CheckpointError(f"{where}: num_hidden_layers is {layers}, but the checkpoint holds tensors of {held} "
                              "layers (model.layers.N.*); correct num_hidden_layers")
    hidden = _integer(config, "hidden_size", where)
    heads = _integer(config, "num_attention_heads", where)
    kv_heads = _integer(config, "num_key_value_heads", where, default=heads, nullable=True)
    if heads % kv_heads:
        raise CheckpointError(f"{where}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads "
                              f"({kv_heads})")
    if config.get("head_dim") is None and hidden % heads:
        raise CheckpointError(f"{where}: has no head_dim, and hidden_size ({hidden}) is not a multiple of "
                              f"num_attention_heads ({heads}); give head_dim")
    head_dim = _integer(config, "head_dim", where, default=hidden // heads, nullable=True)
    experts = per_token = moe_inter = 0
    only: tuple[int, ...] = ()
    if moe:
        key = "num_local_experts" if config.get("num_local_experts") is not None else "num_experts"
        experts = _integer(config, key, where, high=_held(tensors, _EXPERT) or MAX_DIM)
        per_token = _integer(config, "num_experts_per_tok", where, high=experts, default=2)
        moe_inter = _integer(config, "moe_intermediate_size", where)
        only = _mlp_only_layers(config, where, layers)
    out = ReferenceModelConfig(
        vocab_size=_integer(config, "vocab_size", where), hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=_integer(config, "intermediate_size", where),
        num_experts=experts, num_experts_per_tok=per_token if moe else 2, moe_intermediate_size=moe_inter,
        mlp_only_layers=only, rms_norm_eps=_number(config, "rms_norm_eps", where, 1e-6),
        rope_theta=_number(rope, "rope_theta", where, _number(config, "rope_theta", where, 1_000_000.0)),
    )
    if tensors is not None:
        _check_shapes(out, tensors, where, tied=ties_head(config, where))
    return out


def _mlp_only_layers(config: Mapping[str, Any], where: str, layers: int) -> tuple[int, ...]:
    value = config.get("mlp_only_layers")
    if value is None:
        return ()
    if not isinstance(value, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in value):
        raise CheckpointError(f"{where}: mlp_only_layers is {value!r}; it must be a list of layer indices")
    bad = [i for i in value if not 0 <= i < layers]
    if bad:
        raise CheckpointError(f"{where}: mlp_only_layers names layer {bad[0]}; the model has layers 0 to {layers - 1}")
    return tuple(value)


def _check_shapes(cfg: ReferenceModelConfig, tensors: Mapping[str, tuple[int, ...]], where: str, *,
                  tied: bool) -> None:
    missing = []
    for name, shape in hf_weight_shapes(cfg):
        if name not in tensors:
            if not (tied and name == LM_HEAD):
                missing.append(name)
            continue
        if tuple(tensors[name]) != shape:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(tensors[name])}; {where} says {shape} "
                                  "(vocab_size, hidden_size, head counts, intermediate sizes); correct config.json")
    if missing:
        head = (f"; {where} says tie_word_embeddings: false, so the model needs its own {LM_HEAD}"
                if LM_HEAD in missing else "")
        raise CheckpointError(f"the checkpoint lacks {len(missing)} tensors the config needs, e.g. {missing[:3]}{head}")


def check_weight_dtypes(specs: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
    """Refuse a weight the reference model would silently convert: an integer or boolean tensor,
    or a float8 / float4 one (stored quantized, without the scales that would decode it).

    Raises:
        CheckpointError: naming the tensor and its dtype.
    """
    for name, _, dtype in specs:
        if not dtype.is_floating_point or dtype.itemsize < 2:
            raise CheckpointError(f"tensor {name!r} is {str(dtype).removeprefix('torch.')}; the reference model "
                                  "takes floating-point weights (bfloat16, float16, float32): export from the BF16 "
                                  "checkpoint")


def config_from_checkpoint(checkpoint: HfCheckpoint) -> ReferenceModelConfig:
    """The reference model of a checkpoint directory, everything the reference trainer would
    take silently refused first, from the headers alone: a module stored quantized in no layout
    rl-refit decodes (an FP8 weight without its scale), a weight that is not floating point, a
    config.json field of the wrong type or range, and a tensor the shapes need that is missing
    (`lm_head.weight` of an untied model included).

    Raises:
        CheckpointError (QuantizedSource for a stored layout): naming the key or the tensor.
    """
    checkpoint.check_decodable()
    specs = checkpoint.tensor_specs()
    check_weight_dtypes(specs)
    return config_from_hf(checkpoint.config, str(checkpoint.path / "config.json"),
                          {name: shape for name, shape, _ in specs})
