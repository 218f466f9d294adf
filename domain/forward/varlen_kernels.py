"""Reference varlen kernels of a GatedDeltaNet layer, in plain torch.

They are the CPU implementation of the packed GDN forward and the oracle its GPU kernels are
checked against. Both keep packed samples independent and are written so that running them on a
packed batch gives, bit for bit, what running them on each sample alone gives (same operations
in the same order on every token; values from another sample are replaced by exact zeros).
Both are differentiable with autograd.

- `causal_conv1d`: causal depthwise convolution over `[B, T, D]` (channel-last, like fla's
  `causal_conv1d`), restarted wherever `seq_idx` changes; tokens with `seq_idx == -1` (padding)
  output zeros (the convention of the causal-conv1d package).
- `gated_delta_rule`: the recurrent gated delta rule over `[B, T, H, K]` inputs, its state reset
  at every boundary of `cu_seqlens`; the operation order is that of fla's
  `naive_recurrent_gated_delta_rule`.
- `l2norm`: the q/k normalization GDN applies before the rule (fla's `l2norm`, eps 1e-6).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from domain.forward.gdn_packing import build_seq_idx, sequence_starts

_ACTIVATIONS = (None, "silu", "swish")

# CPU SIMD kernels compute the last partial vector of a tensor (or of a thread's chunk) on a
# scalar path whose transcendental functions round differently from the vector path. Rows padded
# to a multiple of _LANES and blocks small enough to stay on one thread put every element on the
# vector path, so an activation gives a token the same bits whether it is packed or alone.
_LANES = 64
_BLOCK_ELEMENTS = 16384


def _position_independent(fn, x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    padded_d = -(-d // _LANES) * _LANES
    padded = F.pad(rows, (0, padded_d - d))
    per_block = max(1, _BLOCK_ELEMENTS // padded_d)
    out = torch.cat([fn(block) for block in padded.split(per_block)]) if rows.shape[0] else padded
    return out[:, :d].reshape(x.shape)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise conv1d that never reaches across a sequence boundary.

    out[b, t, d] = act(bias[d] + sum_i weight[d, i] * x[b, t - W + 1 + i, d]), where a tap
    contributes only when its token has the same `seq_idx` as token t. Accumulates in fp32.

    Args:
        x: `[B, T, D]` input, channel-last.
        weight: `[D, W]` per-channel taps (the last tap multiplies the current token).
        bias: `[D]` or None.
        activation: None, "silu" or "swish".
        seq_idx: `[B, T]` int sample index per token (-1 marks padding), or None for one
            sample per batch row.

    Returns:
        `[B, T, D]` in the dtype of `x`.
    """
    if x.dim() != 3:
        raise ValueError(f"causal_conv1d: x has shape {tuple(x.shape)}, expected [batch, seq, channels]")
    batch, length, channels = x.shape
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(
            f"causal_conv1d: weight has shape {tuple(weight.shape)}, expected [{channels}, width]"
        )
    if activation not in _ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation {activation!r} is not one of {_ACTIVATIONS}")
    if seq_idx is not None and tuple(seq_idx.shape) != (batch, length):
        raise ValueError(
            f"causal_conv1d: seq_idx has shape {tuple(seq_idx.shape)}, expected [{batch}, {length}]"
        )
    width = weight.shape[1]
    xf = F.pad(x.float(), (0, 0, width - 1, 0))
    wf = weight.float()
    if seq_idx is not None:
        # -2 marks the left padding: it matches no token, padding (-1) included.
        sf = F.pad(seq_idx, (width - 1, 0), value=-2)

    def term(i: int) -> torch.Tensor:
        tap = xf[:, i : i + length]
        if seq_idx is not None:
            same = (sf[:, i : i + length] == seq_idx).unsqueeze(-1)
            tap = torch.where(same, tap, torch.zeros_like(tap))
        return tap * wf[:, i]

    out = term(0)
    for i in range(1, width):
        out = out + term(i)
    if bias is not None:
        out = out + bias.float()
    if activation is not None:
        out = _position_independent(F.silu, out)
    if seq_idx is not None:
        out = torch.where((seq_idx >= 0).unsqueeze(-1), out, torch.zeros_like(out))
    return out.to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) along the last dimension, in fp32, returned in x's dtype.

    Args:
        x: any tensor.
        eps: added under the square root.

    Returns:
        The normalized tensor, same shape and dtype as x.
    """
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Recurrent gated delta rule over packed input; the state restarts at every boundary.

    Per head, with state S (`[K, V]`, zero at a sample's first token), for each token t:
    S = S * exp(g_t); u = beta_t * (v_t - S^T k_t); S = S + k_t u^T; o_t = S^T (scale * q_t).
    Computed in fp32; boundaries are turned into per-token reset flags without reading
    `cu_seqlens` on the host.

    Args:
        q, k: `[B, T, H, K]`.
        v: `[B, T, H, V]`.
        g: `[B, T, H]` log-decay (<= 0).
        beta: `[B, T, H]` write strength (after the sigmoid).
        scale: query scale, default 1 / sqrt(K).
        cu_seqlens: `[N + 1]` boundaries of the packed samples (then B must be 1), or None for
            one sample per batch row.

    Returns:
        `[B, T, H, V]` in the dtype of `q`.
    """
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"gated_delta_rule: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not "
            "[B, T, H, K], [B, T, H, K], [B, T, H, V]"
        )
    if g.shape != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(
            f"gated_delta_rule: g {tuple(g.shape)} and beta {tuple(beta.shape)} must be {tuple(q.shape[:3])}"
        )
    batch, length, heads, k_dim = q.shape
    if cu_seqlens is not None and batch != 1:
        raise ValueError(f"gated_delta_rule: packed input (cu_seqlens given) needs batch 1, got {batch}")
    if scale is None:
        scale = 1 / (k_dim**0.5)
    qf, kf, vf, bf, gf = (t.transpose(1, 2).contiguous().float() for t in (q, k, v, beta, g))
    qf = qf * scale
    starts = None
    if cu_seqlens is not None:
        starts = sequence_starts(build_seq_idx(cu_seqlens, length))
    h = torch.zeros(batch, heads, k_dim, v.shape[-1], dtype=torch.float32, device=q.device)
    zeros = torch.zeros_like(h)
    outputs = []
    for i in range(length):
        if starts is not None:
            h = torch.where(starts[i], zeros, h)
        b_k = kf[:, :, i]
        h = h * gf[:, :, i].exp()[..., None, None]
        b_v = vf[:, :, i] - (h * b_k[..., None]).sum(-2)
        b_v = b_v * bf[:, :, i][..., None]
        h = h + b_k.unsqueeze(-1) * b_v.unsqueeze(-2)
        outputs.append(torch.einsum("bhd,bhdm->bhm", qf[:, :, i], h))
    if not outputs:
        return torch.zeros(batch, 0, heads, v.shape[-1], dtype=q.dtype, device=q.device)
    return torch.stack(outputs, dim=2).transpose(1, 2).to(q.dtype)
