"""The reference model's fused layout and its forward pass, shared by the trainer and the engine.

Both sides run `forward_logits` on a mapping of *effective* weights (bfloat16, fused layout): the
trainer passes its parameters, the engine passes what it dequantizes from its rollout-format
storage and adds activation fake-quantization. With a BF16 refit the two mappings are equal bit
for bit, so the logits are too.

Fused keys: `embed`, `norm`, `lm_head`, and per layer `layers.{i}.` + `input_norm`, `post_norm`,
`q_norm`, `k_norm`, `qkv` [Nq + 2 Nkv, H], `o` [H, Nq], then `gate_up` [2I, H] and `down` [H, I]
(dense MLP) or `router` [E, H], `w13` [E, 2I, H] and `w2` [E, H, I] (experts).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs
import torch
import torch.nn.functional as F

from adapters.reference.config import ReferenceModelConfig, hf_weight_shapes

ActQuant = Callable[[str, torch.Tensor], torch.Tensor]


@attrs.frozen
class Slot:
    """Where one Hugging Face tensor lives in the fused layout.

    Attributes:
        key: the fused tensor's key, e.g. `layers.0.qkv`.
        expert: the expert index for stacked expert tensors, else None.
        rows: the rows of the fused tensor (of the expert's matrix) it occupies.
        shard: its position among the fused tensor's members (q=0, k=1, v=2; gate=0, up=1).
        num_shards: members of the fused tensor.
    """

    key: str
    expert: int | None
    rows: slice
    shard: int
    num_shards: int


_SUFFIX = {
    "input_layernorm": "input_norm",
    "post_attention_layernorm": "post_norm",
    "self_attn.q_norm": "q_norm",
    "self_attn.k_norm": "k_norm",
    "self_attn.o_proj": "o",
    "mlp.down_proj": "down",
    "mlp.gate": "router",
}


def slot_table(cfg: ReferenceModelConfig) -> dict[str, Slot]:
    """Every Hugging Face module name (without `.weight`) -> its Slot in the fused layout.

    Args:
        cfg: the model configuration.

    Returns:
        A dict in layer order.
    """
    q, kv = cfg.q_size, cfg.kv_size
    table: dict[str, Slot] = {}
    for name, shape in hf_weight_shapes(cfg):
        module = name.removesuffix(".weight")
        rows = slice(0, shape[0])
        if module == "model.embed_tokens":
            table[module] = Slot("embed", None, rows, 0, 1)
            continue
        if module in ("model.norm", "lm_head"):
            table[module] = Slot(module.removeprefix("model."), None, rows, 0, 1)
            continue
        _, _, layer, rest = module.split(".", 3)
        p = f"layers.{layer}."
        if rest in _SUFFIX:
            table[module] = Slot(p + _SUFFIX[rest], None, rows, 0, 1)
        elif rest in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            shard = "qkv".index(rest[10])
            start = (0, q, q + kv)[shard]
            table[module] = Slot(p + "qkv", None, slice(start, start + shape[0]), shard, 3)
        elif rest in ("mlp.gate_proj", "mlp.up_proj"):
            shard = int(rest == "mlp.up_proj")
            table[module] = Slot(p + "gate_up", None, slice(shard * shape[0], (shard + 1) * shape[0]), shard, 2)
        else:  # mlp.experts.{e}.{gate,up,down}_proj
            _, _, e, proj = rest.split(".")
            if proj == "down_proj":
                table[module] = Slot(p + "w2", int(e), rows, 0, 1)
            else:
                shard = int(proj == "up_proj")
                sl = slice(shard * shape[0], (shard + 1) * shape[0])
                table[module] = Slot(p + "w13", int(e), sl, shard, 2)
    return table


def fused_shapes(cfg: ReferenceModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every fused tensor, by key, in layer order.

    Args:
        cfg: the model configuration.

    Returns:
        key -> shape; stacked expert tensors are [E, rows, cols].
    """
    shapes: dict[str, list[int]] = {}
    hf = dict(hf_weight_shapes(cfg))
    for module, slot in slot_table(cfg).items():
        shape = hf[module + ".weight"]
        cur = shapes.setdefault(slot.key, [0, *list(shape[1:])])
        cur[0] = max(cur[0], slot.rows.stop)
    out: dict[str, tuple[int, ...]] = {}
    for key, dims in shapes.items():
        leaf = key.rsplit(".", 1)[-1]
        out[key] = (cfg.num_experts, *dims) if leaf in ("w13", "w2") else tuple(dims)
    return out


# --- forward -------------------------------------------------------------------------------


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def _rope(cfg: ReferenceModelConfig, seq: int, dtype: torch.dtype,
          device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, computed on the host (the same values on every device) and moved to `device`."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _attention(cfg: ReferenceModelConfig, w: Mapping[str, torch.Tensor], p: str, x: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor], act: ActQuant) -> torch.Tensor:
    b, t, _ = x.shape
    qkv = F.linear(act(p + "qkv", x), w[p + "qkv"])
    q, k, v = qkv.split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
    q = _rms_norm(q.view(b, t, cfg.num_heads, cfg.head_dim), w[p + "q_norm"], cfg.rms_norm_eps).transpose(1, 2)
    k = _rms_norm(k.view(b, t, cfg.num_kv_heads, cfg.head_dim), w[p + "k_norm"], cfg.rms_norm_eps).transpose(1, 2)
    v = v.view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
    cos, sin = rope
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    rep = cfg.num_heads // cfg.num_kv_heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * cfg.head_dim**-0.5
    causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
    scores = scores.masked_fill(causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, cfg.q_size)
    return F.linear(act(p + "o", out), w[p + "o"])


def _dense_mlp(w: Mapping[str, torch.Tensor], p: str, x: torch.Tensor, act: ActQuant) -> torch.Tensor:
    gate, up = F.linear(act(p + "gate_up", x), w[p + "gate_up"]).chunk(2, dim=-1)
    return F.linear(act(p + "down", F.silu(gate) * up), w[p + "down"])


def _moe(cfg: ReferenceModelConfig, w: Mapping[str, torch.Tensor], p: str, x: torch.Tensor,
         act: ActQuant) -> torch.Tensor:
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    logits = F.linear(flat, w[p + "router"])
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_w, top_i = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
    top_w = (top_w / top_w.sum(dim=-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(flat)
    w13, w2 = w[p + "w13"], w[p + "w2"]
    for e in range(cfg.num_experts):
        token, pos = torch.where(top_i == e)
        if token.numel() == 0:
            continue
        gate, up = F.linear(act(p + "w13", flat[token]), w13[e]).chunk(2, dim=-1)
        y = F.linear(act(p + "w2", F.silu(gate) * up), w2[e])
        # A token picks an expert at most once, so rows never repeat: a plain gather-add-scatter
        # (index_add_ has no fast bfloat16 path on CPU).
        out[token] = out[token] + y * top_w[token, pos, None]
    return out.reshape(shape)


def _no_quant(_key: str, x: torch.Tensor) -> torch.Tensor:
    return x


@torch.no_grad()
def forward_logits(
    cfg: ReferenceModelConfig,
    w: Mapping[str, torch.Tensor],
    input_ids: torch.Tensor,
    act: ActQuant | None = None,
) -> torch.Tensor:
    """Logits of every position, float32 [B, T, V].

    Args:
        cfg: the model configuration.
        w: effective weights in the fused layout (see the module docstring).
        input_ids: int64 [B, T].
        act: activation fake-quantization, called as act(fused key, input) before each Linear;
            None = none.

    Returns:
        float32 logits [B, T, V].
    """
    act = act or _no_quant
    h = F.embedding(input_ids, w["embed"])
    rope = _rope(cfg, input_ids.shape[1], h.dtype, h.device)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        h = h + _attention(cfg, w, p, _rms_norm(h, w[p + "input_norm"], cfg.rms_norm_eps), rope, act)
        x = _rms_norm(h, w[p + "post_norm"], cfg.rms_norm_eps)
        h = h + (_moe(cfg, w, p, x, act) if cfg.is_moe_layer(i) else _dense_mlp(w, p, x, act))
    h = _rms_norm(h, w["norm"], cfg.rms_norm_eps)
    return F.linear(h, w["lm_head"]).float()


def log_probs_from_logits(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each next token and the entropy of each next-token distribution.

    Args:
        logits: float32 [B, T, V].
        input_ids: int64 [B, T].
        temperature: logits are divided by it.

    Returns:
        (log_probs, entropy), float32 [B, T - 1]; position t scores input_ids[:, t + 1].
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    token_logp = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return token_logp, entropy


def check_input_ids(cfg: ReferenceModelConfig, input_ids: torch.Tensor) -> None:
    """Reject token batches the model cannot score, naming the problem."""
    if input_ids.dtype != torch.int64 or input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(
            f"input_ids must be int64 [B, T] with T >= 2, got {input_ids.dtype} {tuple(input_ids.shape)}"
        )
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= cfg.vocab_size):
        raise ValueError(f"input_ids must lie in [0, {cfg.vocab_size}), the model's vocabulary")
