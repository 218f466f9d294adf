"""The fields of a checkpoint's config.json that transformers and the engines build a model from,
checked against the tensors present before anything is built (docs/errors.md#checkpointerror):
an integer where one must be, at least 1, and no larger than the tensors allow, so that a
`vocab_size` of 10**12 or a `num_hidden_layers` of 10**9 is one line naming the key instead of an
allocation that fails deep inside a library, or a model built for ever."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from domain.errors import CheckpointError
from domain.quant.naming import layer_index

if TYPE_CHECKING:
    from adapters.hf_checkpoint.reader import HfCheckpoint

# Keys every causal LM's config needs (null refused); then sizes that may be absent or null.
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
_SIZES = ("intermediate_size", "num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts",
          "num_local_experts", "num_experts_per_tok", "n_routed_experts")
_FLAGS = ("tie_word_embeddings", "attention_bias", "use_sliding_window", "norm_topk_prob")


def _sections(config: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    text = config.get("text_config")
    return [("", config)] + ([("text_config.", text)] if isinstance(text, Mapping) else [])


def check_model_config(config: Mapping[str, Any], tensors: list[tuple[str, tuple[int, ...]]],
                       where: str = "config.json") -> None:
    """Raise CheckpointError naming the key when a field the model is built from has the wrong
    type, is below 1, or exceeds what the tensors hold.

    Args:
        config: the parsed config.json.
        tensors: the checkpoint's (name, shape) pairs (headers only).
        where: the file, for errors.
    """
    largest = max((d for _, shape in tensors for d in shape), default=0)
    layers = {i for name, _ in tensors if (i := layer_index(name)) is not None}
    bound = max(largest, len(tensors))  # a count of experts may be stacked in a dimension or split in tensors
    for prefix, section in _sections(config):
        has_sizes = any(k in section for k in _REQUIRED)
        for key in (*_REQUIRED, *_SIZES) if has_sizes else ():
            if key not in section or (section[key] is None and key not in _REQUIRED):
                continue
            value = section[key]
            if isinstance(value, bool) or not isinstance(value, int):
                raise CheckpointError(f"{where}: {prefix}{key} is {json.dumps(value)}; it must be an integer")
            held = max(layers) + 1 if layers else 0
            high = (held or bound) if key == "num_hidden_layers" else bound
            if not 1 <= value <= max(high, 1):
                what = (f"the checkpoint holds tensors of {held} layers" if key == "num_hidden_layers" and held
                        else f"no tensor of the checkpoint has a dimension above {largest}")
                raise CheckpointError(f"{where}: {prefix}{key} is {value}; it must be at least 1, and {what}; "
                                      f"correct {key}")
        if has_sizes:
            _check_embedding(section, prefix, tensors, where)
            _check_projections(section, prefix, tensors, where)
            _check_head(section, prefix, tensors, where)
        for key in ("rope_parameters", "rope_scaling"):
            if section.get(key) is not None and not isinstance(section[key], Mapping):
                raise CheckpointError(f"{where}: {prefix}{key} is {section[key]!r}; it must be an object such as "
                                      '{"rope_type": "default", "rope_theta": 1000000.0}, or null')
        for key in _FLAGS:
            if section.get(key) is not None and not isinstance(section[key], bool):
                raise CheckpointError(f"{where}: {prefix}{key} is {section[key]!r}; it must be true or false")


def _check_embedding(section: Mapping[str, Any], prefix: str, tensors: list[tuple[str, tuple[int, ...]]],
                     where: str) -> None:
    """vocab_size and hidden_size against the token embedding's [vocab, hidden] shape, when the
    checkpoint has one (a model is built at the config's sizes and then refuses the tensor)."""
    shapes = [shape for name, shape in tensors if name.endswith("embed_tokens.weight") and len(shape) == 2]
    if len(shapes) != 1:
        return
    rows, cols = shapes[0]
    for key, held in (("vocab_size", rows), ("hidden_size", cols)):
        value = section.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value != held:
            raise CheckpointError(f"{where}: {prefix}{key} is {value}, but the token embedding is [{rows}, {cols}]; "
                                  f"correct {key} to {held}")


def _check_head(section: Mapping[str, Any], prefix: str, tensors: list[tuple[str, tuple[int, ...]]],
                where: str) -> None:
    """An untied model (tie_word_embeddings false, or absent where the model type's default is
    false) must carry its own output head: an engine builds it and, with no tensor for it, serves
    the head it was initialised with (random), while every other missing tensor is refused."""
    tied = section.get("tie_word_embeddings")
    if tied is None and section.get("model_type") in _LLAMA_LIKE:
        tied = False  # LlamaConfig, Qwen2Config, Qwen3Config, MistralConfig and their MoE configs default to untied
    if tied is not False or any(name.rpartition(".")[0].endswith("lm_head") for name, _ in tensors):
        return
    said = "is false" if "tie_word_embeddings" in section else f"is absent (false for {section.get('model_type')})"
    raise CheckpointError(f"{where}: {prefix}tie_word_embeddings {said}, but the checkpoint has no lm_head.weight: "
                          "an engine would serve an output head it initialised at random; add the head's tensor, or "
                          "set tie_word_embeddings to true if the model shares its token embedding")


# Model types whose decoder layers are laid out as Llama's: q/k/v/o and gate/up/down projections whose
# shapes follow from the config alone, and no layer beyond num_hidden_layers (no multi-token head).
_LLAMA_LIKE = frozenset({"llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})
_PROJECTION = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.weight$")


def _int(value: Any) -> int | None:
    """`value` when it is an integer (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _check_projections(section: Mapping[str, Any], prefix: str, tensors: list[tuple[str, tuple[int, ...]]],
                       where: str) -> None:
    """The attention and dense MLP projections, and the layer count, against the sizes that build
    them, for the Llama-like model types (a model built at other sizes refuses the tensor, or
    silently drops the layers beyond its count)."""
    if section.get("model_type") not in _LLAMA_LIKE:
        return
    hidden, heads, layers = (_int(section.get(k)) for k in ("hidden_size", "num_attention_heads", "num_hidden_layers"))
    if hidden is None or heads is None or layers is None:
        return  # the integer checks above name the key
    kv, head_dim, inter = (_int(section.get(k)) for k in ("num_key_value_heads", "head_dim", "intermediate_size"))
    kv = heads if kv is None else kv
    head_dim = hidden // heads if head_dim is None else head_dim
    keys = f"{prefix}num_attention_heads, {prefix}num_key_value_heads, {prefix}head_dim and {prefix}hidden_size"
    expected = {
        "self_attn.q_proj": ((heads * head_dim, hidden), keys), "self_attn.k_proj": ((kv * head_dim, hidden), keys),
        "self_attn.v_proj": ((kv * head_dim, hidden), keys), "self_attn.o_proj": ((hidden, heads * head_dim), keys),
    }
    if inter is not None:
        mlp_keys = f"{prefix}intermediate_size and {prefix}hidden_size"
        expected |= {"mlp.gate_proj": ((inter, hidden), mlp_keys), "mlp.up_proj": ((inter, hidden), mlp_keys),
                     "mlp.down_proj": ((hidden, inter), mlp_keys)}
    for name, shape in tensors:
        m = _PROJECTION.search(name)
        if m is None:
            continue
        if int(m.group(1)) >= layers:
            raise CheckpointError(f"{where}: {prefix}num_hidden_layers is {layers}, but the checkpoint holds {name!r} "
                                  f"(layer {m.group(1)}); correct num_hidden_layers")
        want = expected.get(m.group(2))
        if want is not None and len(shape) == 2 and tuple(shape) != want[0]:
            raise CheckpointError(f"{where}: {name!r} is {list(shape)}, but {want[1]} make it {list(want[0])}; "
                                  "correct those keys")


def check_checkpoint_config(checkpoint: HfCheckpoint) -> None:
    """check_model_config on a checkpoint directory's config.json and tensors (headers only)."""
    check_model_config(checkpoint.config, checkpoint.tensor_shapes(raw=True), str(checkpoint.path / "config.json"))
