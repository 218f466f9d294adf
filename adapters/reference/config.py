"""Shapes of the embedded reference model: a tiny Qwen3-like causal LM, dense or with MoE layers.

The model keeps its weights in a fused layout (q/k/v in one matrix, gate/up in one, experts
stacked in 3-D), as Megatron and vLLM do, and presents them under Hugging Face checkpoint names,
one 2-D tensor per projection and per expert (`mlp.experts.3.gate_proj.weight`).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs


def _layers(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(i) for i in value)


def _positive(_inst: object, attr: attrs.Attribute, value: int) -> None:
    if value <= 0:
        raise ValueError(f"reference model: {attr.name} must be > 0, got {value}")


@attrs.frozen
class ReferenceModelConfig:
    """A Qwen3 / Qwen3-MoE-like decoder.

    Attributes:
        vocab_size: tokens in the vocabulary.
        hidden_size: model width H.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention).
        head_dim: width of one head.
        intermediate_size: width of a dense MLP.
        num_experts: routed experts of an MoE layer (0 = every layer dense).
        num_experts_per_tok: experts each token is routed to.
        moe_intermediate_size: width of one expert's MLP.
        mlp_only_layers: layers that keep a dense MLP although the model has experts.
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: rotary embedding base.
        init_std: standard deviation of the random Linear weights.
        embed_std: standard deviation of the random token embeddings and LM head.
    """

    vocab_size: int = attrs.field(validator=_positive)
    hidden_size: int = attrs.field(validator=_positive)
    num_layers: int = attrs.field(validator=_positive)
    num_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    intermediate_size: int = attrs.field(validator=_positive)
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    mlp_only_layers: tuple[int, ...] = attrs.field(default=(), converter=_layers)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    init_std: float = 0.02
    embed_std: float = 1.0

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("reference model: num_heads must be a multiple of num_kv_heads")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise ValueError("reference model: num_experts_per_tok must be in [1, num_experts]")
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ValueError("reference model: an MoE model needs moe_intermediate_size > 0")

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.mlp_only_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return any(self.is_moe_layer(i) for i in range(self.num_layers))

    def num_parameters(self) -> int:
        """Parameters of the whole model (every expert counted)."""
        return sum(_numel(s) for _, s in hf_weight_shapes(self))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def hf_weight_shapes(cfg: ReferenceModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every weight's Hugging Face name and shape, in layer order (the refit stream's order).

    Args:
        cfg: the model configuration.

    Returns:
        (name, shape) pairs: embeddings, each layer's norms, attention and MLP (or router and
        per-expert projections), the final norm and the LM head.
    """
    h, d = cfg.hidden_size, cfg.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (cfg.vocab_size, h))]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (cfg.q_size, h)),
            (f"{p}.self_attn.k_proj.weight", (cfg.kv_size, h)),
            (f"{p}.self_attn.v_proj.weight", (cfg.kv_size, h)),
            (f"{p}.self_attn.o_proj.weight", (h, cfg.q_size)),
            (f"{p}.self_attn.q_norm.weight", (d,)),
            (f"{p}.self_attn.k_norm.weight", (d,)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
        ]
        if cfg.is_moe_layer(i):
            inter = cfg.moe_intermediate_size
            out.append((f"{p}.mlp.gate.weight", (cfg.num_experts, h)))
            for e in range(cfg.num_experts):
                out += [
                    (f"{p}.mlp.experts.{e}.gate_proj.weight", (inter, h)),
                    (f"{p}.mlp.experts.{e}.up_proj.weight", (inter, h)),
                    (f"{p}.mlp.experts.{e}.down_proj.weight", (h, inter)),
                ]
        else:
            inter = cfg.intermediate_size
            out += [
                (f"{p}.mlp.gate_proj.weight", (inter, h)),
                (f"{p}.mlp.up_proj.weight", (inter, h)),
                (f"{p}.mlp.down_proj.weight", (h, inter)),
            ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (cfg.vocab_size, h))]
    return out


# The presets. TINY_MOE is the demo's default: a dense first layer, then MoE layers, so that the
# default plan (linear FP8_BLOCK, moe NVFP4) exercises both. Every projection's rows are a
# multiple of 128, so FP8 128x128 blocks never straddle two fused shards.
TINY_MOE = ReferenceModelConfig(
    vocab_size=2048,
    hidden_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=512,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    mlp_only_layers=(0,),
)
TINY_DENSE = attrs.evolve(TINY_MOE, num_experts=0, moe_intermediate_size=0, mlp_only_layers=())
# >= 200M parameters, for `refit bench refit`.
BENCH_MOE = ReferenceModelConfig(
    vocab_size=16384,
    hidden_size=1024,
    num_layers=8,
    num_heads=16,
    num_kv_heads=8,
    head_dim=64,
    intermediate_size=4096,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=512,
    mlp_only_layers=(0,),
)

# The smallest model with every kind of module (tests, quick runs).
MICRO_MOE = ReferenceModelConfig(
    vocab_size=512,
    hidden_size=128,
    num_layers=2,
    num_heads=2,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=256,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    mlp_only_layers=(0,),
)

MICRO_DENSE = attrs.evolve(MICRO_MOE, num_experts=0, moe_intermediate_size=0, mlp_only_layers=())

# 48M parameters with wide layers: `refit bench transport --quick` (the full run uses bench-moe).
BENCH_QUICK = ReferenceModelConfig(
    vocab_size=8192, hidden_size=1024, num_layers=2, num_heads=16, num_kv_heads=8, head_dim=64,
    intermediate_size=4096, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512, mlp_only_layers=(0,),
)

PRESETS: dict[str, ReferenceModelConfig] = {
    "tiny-moe": TINY_MOE,
    "tiny-dense": TINY_DENSE,
    "micro-moe": MICRO_MOE,
    "micro-dense": MICRO_DENSE,
    "bench-moe": BENCH_MOE,
    "bench-quick": BENCH_QUICK,
}


def preset(name: str) -> ReferenceModelConfig:
    """A model preset by name (`tiny-moe`, `tiny-dense`, `micro-moe`, `bench-moe`, `bench-quick`).

    Raises:
        KeyError: naming the valid presets.
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown reference model {name!r}; valid: {', '.join(PRESETS)}") from None
