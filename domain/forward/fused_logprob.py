"""Fused linear log-prob and entropy: never materializes [tokens, vocab] logits.

For hidden states h [T, H], an output weight W [V, H], labels y [T] and a temperature tau, with
z = (h @ W^T) / tau, it returns per token

    log_prob = z[y] - logsumexp(z)          entropy = logsumexp(z) - sum softmax(z) * z

computed over chunks of tokens. The backward recomputes each chunk's logits instead of saving
them, so peak memory is O(chunk x V) rather than O(T x V). With a process group whose ranks each
hold one equal vocabulary shard of W (Megatron's vocabulary-parallel output layer), the max, the
sum of exponentials, the label logit and the softmax-weighted logit are all-reduced across it.

Precision: logits come out of the matmul in the input dtype (bf16 matmuls accumulate in fp32
and round their output, exactly as a plain `hidden @ W.T` does); everything after that is fp32:
the temperature division, the reductions, the gradient with respect to the logits, and the
weight-gradient accumulator. This module is the reference implementation and the CPU one.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from domain.errors import InvalidTemperature, InvalidTensor, UnsupportedDtype

IGNORE_INDEX = -100
# Default bytes of one [chunk, vocab] float32 buffer; each pass holds about two of them. Each chunk
# reads the whole weight, so larger chunks are faster; 256 MiB keeps the extra memory near
# 0.5 GiB (441 tokens at vocab 151,936).
DEFAULT_CHUNK_BYTES = 256 * 2**20


class VocabGroup(Protocol):
    """The ranks that each hold one equal shard of the vocabulary (Megatron's vocabulary-parallel
    output layer): the seam through which the fused computation reduces across them.
    `adapters.distributed.vocab_group.TorchVocabGroup` is the torch.distributed one."""

    @property
    def size(self) -> int:
        """Ranks in the group."""
        ...

    @property
    def rank(self) -> int:
        """This rank's place in the group: it holds vocabulary ids [rank * V_local, (rank + 1) * V_local)."""
        ...

    def all_reduce_max(self, t: torch.Tensor) -> None:
        """Replace `t`, in place, with its element-wise maximum over the group."""
        ...

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        """Replace `t`, in place, with its element-wise sum over the group."""
        ...


def auto_chunk_size(vocab_size: int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk such that one float32 [chunk, vocab_size] buffer fits in `chunk_bytes`.

    Args:
        vocab_size: the (local) vocabulary size of the weight.
        chunk_bytes: the byte budget of one buffer.

    Returns:
        A chunk size of at least 1.
    """
    return max(1, chunk_bytes // (4 * max(1, vocab_size)))


def fused_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    vocab_group: VocabGroup | None = None,
    reduce_hidden_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each label and entropy of each token's distribution, chunked.

    Args:
        hidden: [..., H] floating hidden states (the final-norm output).
        weight: [V_local, H] output weight, same dtype as `hidden`. With `vocab_group`, this
            rank's shard: rank r holds vocabulary ids [r * V_local, (r + 1) * V_local).
        labels: [...] integer token ids (global ids), same leading shape as `hidden`.
            Positions equal to `ignore_index` get log-prob 0 and entropy 0 and no gradient.
        temperature: logits are divided by it; finite and > 0.
        chunk_size: tokens per chunk; None picks `auto_chunk_size(V_local)`.
        ignore_index: label value of positions to skip (padding, last token of a sequence).
        vocab_group: the group over which the vocabulary is sharded; None for a full W.
        reduce_hidden_grad: with `vocab_group`, all-reduce the hidden-state gradient across it
            (each shard only sees its part). Pass False when the caller's own communication
            does that already (Megatron's sequence-parallel gather reduce-scatters it).

    Returns:
        (log_probs, entropy), float32 (float64 for float64 inputs) with the leading shape of
        `labels`.

    Raises:
        InvalidTensor: mismatched shapes, labels outside the vocabulary, or a bad chunk size.
        UnsupportedDtype: non-floating hidden/weight, mismatched dtypes, or non-integer labels.
        InvalidTemperature: temperature not finite or not positive.
    """
    _validate(hidden, weight, labels, temperature, chunk_size)
    lead_shape = labels.shape
    h2 = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    world = vocab_group.size if vocab_group is not None else 1
    rank = vocab_group.rank if vocab_group is not None else 0
    _validate_labels(y, weight.shape[0] * world, ignore_index)
    chunk = chunk_size if chunk_size is not None else auto_chunk_size(weight.shape[0])
    logp, ent = _FusedLogProbEntropy.apply(
        h2,
        weight,
        y,
        float(temperature),
        int(chunk),
        int(ignore_index),
        vocab_group if world > 1 else None,
        rank * weight.shape[0],
        bool(reduce_hidden_grad),
    )
    return logp.reshape(lead_shape), ent.reshape(lead_shape)


def reference_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain path: full [T, V] logits, `log_softmax`, gather. Same contract, single rank.

    It is what a trainer computes without fusion (and the baseline of `refit bench logprobs`).

    Args:
        hidden, weight, labels, temperature, ignore_index: as in `fused_logprob_entropy`.

    Returns:
        (log_probs, entropy), float32 with the leading shape of `labels`.
    """
    _validate(hidden, weight, labels, temperature, None)
    logits = (hidden @ weight.T).to(_acc_dtype(hidden)) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    keep = labels != ignore_index
    safe = torch.where(keep, labels, torch.zeros_like(labels))
    logp = logp_all.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    return torch.where(keep, logp, zero), torch.where(keep, entropy, zero)


def validate_temperature(temperature: object) -> float:
    """Check a sampling temperature.

    Args:
        temperature: the value to check.

    Returns:
        It, as a float.

    Raises:
        InvalidTemperature: not a real number, not finite, or not > 0.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise InvalidTemperature(f"temperature must be a float, got {temperature!r}")
    if not math.isfinite(temperature) or temperature <= 0:
        raise InvalidTemperature(f"temperature must be finite and > 0, got {temperature!r}")
    return float(temperature)


def _validate(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    chunk_size: int | None,
) -> None:
    if not hidden.is_floating_point():
        raise UnsupportedDtype("hidden", f"dtype {hidden.dtype} is not floating", "pass the hidden states")
    if weight.dtype != hidden.dtype:
        raise UnsupportedDtype(
            "weight", f"dtype {weight.dtype} differs from hidden {hidden.dtype}", "cast one to the other"
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        raise UnsupportedDtype("labels", f"dtype {labels.dtype} is not an integer type", "pass token ids")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise InvalidTensor(
            "weight",
            f"shape {tuple(weight.shape)} is not [vocab, {hidden.shape[-1]}]",
            "pass the output-layer weight [vocab, hidden]",
        )
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise InvalidTensor(
            "labels",
            f"shape {tuple(labels.shape)} does not match hidden {tuple(hidden.shape)}",
            "give one label per hidden-state position",
        )
    validate_temperature(temperature)
    if chunk_size is not None and (isinstance(chunk_size, bool) or int(chunk_size) < 1):
        raise InvalidTensor("chunk_size", f"{chunk_size!r} is not a positive token count", "use None or >= 1")


def _validate_labels(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    if labels.numel() == 0:
        return
    kept = labels[labels != ignore_index]
    if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= vocab_size):
        raise InvalidTensor(
            "labels",
            f"ids span [{int(kept.min())}, {int(kept.max())}] outside the vocabulary [0, {vocab_size})",
            f"use ids below {vocab_size}, or {ignore_index} for positions to skip",
        )


def _all_max(t: torch.Tensor, group: VocabGroup | None) -> torch.Tensor:
    if group is not None:
        group.all_reduce_max(t)
    return t


def _all_sum(t: torch.Tensor, group: VocabGroup | None) -> torch.Tensor:
    if group is not None:
        group.all_reduce_sum(t)
    return t


class _FusedLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, labels, temperature, chunk, ignore_index, group, vocab_start, reduce_grad
    ):
        n_tok, vocab = hidden.shape[0], weight.shape[0]
        f32 = dict(dtype=_acc_dtype(hidden), device=hidden.device)
        logp = torch.zeros(n_tok, **f32)
        entropy = torch.zeros(n_tok, **f32)
        row_max = torch.zeros(n_tok, **f32)  # global max of z, per token
        log_sum = torch.zeros(n_tok, **f32)  # log sum exp(z - max)
        mean_shift = torch.zeros(n_tok, **f32)  # sum softmax(z) * (z - max)
        for s in range(0, n_tok, chunk):
            e = min(s + chunk, n_tok)
            z = _chunk_logits(hidden[s:e], weight, temperature)
            m = _all_max(z.amax(dim=-1), group)
            z.sub_(m.unsqueeze(-1))
            local, in_shard = _local_labels(labels[s:e], vocab_start, vocab, ignore_index)
            label_z = torch.where(in_shard, z.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
            ez = torch.exp(z)
            sums = torch.stack([ez.sum(-1), ez.mul_(z).sum(-1), label_z])
            del ez, z
            sum_exp, dot, label_z = _all_sum(sums, group)
            keep = labels[s:e] != ignore_index
            ls = torch.log(sum_exp)
            row_max[s:e], log_sum[s:e], mean_shift[s:e] = m, ls, dot / sum_exp
            logp[s:e] = torch.where(keep, label_z - ls, 0.0)
            entropy[s:e] = torch.where(keep, ls - dot / sum_exp, 0.0)
        ctx.save_for_backward(hidden, weight, labels, row_max, log_sum, mean_shift)
        ctx.cfg = (temperature, chunk, ignore_index, group, vocab_start, reduce_grad)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, labels, row_max, log_sum, mean_shift = ctx.saved_tensors
        temperature, chunk, ignore_index, group, vocab_start, reduce_grad = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n_tok, vocab = hidden.shape[0], weight.shape[0]
        keep = labels != ignore_index
        acc = _acc_dtype(hidden)
        g_lp = torch.where(keep, grad_logp.to(acc), 0.0)
        g_ent = torch.where(keep, grad_entropy.to(acc), 0.0)
        grad_h = torch.empty(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        grad_w: torch.Tensor | None = None
        lse = row_max + log_sum  # logsumexp(z), z = logits / temperature
        mean_z = row_max + mean_shift  # E_softmax[z]
        # With l the raw logits, z = l / tau, p = softmax(z):
        #   d log_prob / dl = (onehot(label) - p) / tau;  d entropy / dl = p * (E[z] - z) / tau
        # so dL/dl = p * (a * l + b) + onehot * g_lp / tau, with the per-token scalars below.
        # Folding the temperature into them keeps the [chunk, vocab] passes to five.
        inv_tau = 1.0 / temperature
        a = -g_ent * inv_tau * inv_tau
        b = (g_ent * mean_z - g_lp) * inv_tau
        for s in range(0, n_tok, chunk):
            e = min(s + chunk, n_tok)
            grad_l = _chunk_logits(hidden[s:e], weight, 1.0)
            p = torch.add(-lse[s:e].unsqueeze(-1), grad_l, alpha=inv_tau).exp_()
            grad_l.mul_(a[s:e].unsqueeze(-1)).add_(b[s:e].unsqueeze(-1)).mul_(p)
            del p
            local, in_shard = _local_labels(labels[s:e], vocab_start, vocab, ignore_index)
            onehot = torch.where(in_shard, g_lp[s:e] * inv_tau, 0.0)
            grad_l.scatter_add_(-1, local.unsqueeze(-1), onehot.unsqueeze(-1))
            if grad_h is not None:
                grad_h[s:e] = grad_l.to(weight.dtype) @ weight
            if need_w:
                h_chunk = hidden[s:e].to(acc)
                grad_w = grad_l.T @ h_chunk if grad_w is None else grad_w.addmm_(grad_l.T, h_chunk)
        if need_w and grad_w is None:  # no tokens at all
            grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        if grad_h is not None and reduce_grad:
            _all_sum(grad_h, group)
        return (
            grad_h.to(hidden.dtype) if grad_h is not None else None,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            *([None] * 7),
        )


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    # float32 for half types and float32; float64 inputs keep float64 (exact gradient checks).
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    # The matmul runs in the input dtype; the accumulation-dtype copy owns its memory and is
    # edited in place from here on.
    z = hidden @ weight.T
    acc = _acc_dtype(hidden)
    z = z.to(acc) if z.dtype != acc else z
    return z.div_(temperature) if temperature != 1.0 else z


def _local_labels(
    labels: torch.Tensor, vocab_start: int, vocab: int, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    local = labels - vocab_start
    in_shard = (labels != ignore_index) & (local >= 0) & (local < vocab)
    return torch.where(in_shard, local, torch.zeros_like(local)), in_shard
