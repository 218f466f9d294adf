"""Varlen kernel sets for the packed GatedDeltaNet forward, injected rather than imported.

A `GdnKernels` bundles the three kernels the packed forward calls, all with one calling
convention (channel-last `[1, T, D]` conv input, `[1, T, H, *]` rule input):

- `conv(x, weight, bias, activation, cu_seqlens, seq_idx) -> [1, T, D]`
- `gated_delta_rule(q, k, v, g, beta, cu_seqlens) -> [1, T, H, V]`
- `l2norm(x) -> x / ||x||` along the last dimension

Sets:
- `reference`: the plain-torch kernels of `domain.forward.varlen_kernels` (CPU, and the test oracle);
- `fla`: flash-linear-attention's `causal_conv1d(cu_seqlens=...)`,
  `chunk_gated_delta_rule(cu_seqlens=...)` and `l2norm` (Triton, GPU);
- `causal_conv1d`: the causal-conv1d package's `causal_conv1d_fn(seq_idx=...)` for the
  convolution (channel-last layout), fla for the rest; the fallback when fla's convolution is
  unavailable.

This module imports neither megatron nor fla at import time; the GPU check script uses it alone.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from domain.forward import varlen_kernels

KERNEL_SETS = ("auto", "reference", "fla", "causal_conv1d")


@attrs.frozen
class GdnKernels:
    """The kernels a packed GDN forward calls. `name` says which set they came from."""

    name: str
    conv: Callable[..., torch.Tensor]
    gated_delta_rule: Callable[..., torch.Tensor]
    l2norm: Callable[[torch.Tensor], torch.Tensor]


def _reference_conv(x, weight, bias, activation, cu_seqlens, seq_idx):
    return varlen_kernels.causal_conv1d(x, weight, bias, activation, seq_idx=seq_idx)


def _reference_rule(q, k, v, g, beta, cu_seqlens):
    return varlen_kernels.gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_seqlens)


def reference_kernels() -> GdnKernels:
    """Plain-torch kernels: run anywhere, bit-identical packed or per sequence."""
    return GdnKernels("reference", _reference_conv, _reference_rule, varlen_kernels.l2norm)


def _import_fla(what: str):
    try:
        from fla.modules.l2norm import l2norm
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as err:
        raise ModuleNotFoundError(
            f"GdnKernels '{what}' (adapters.megatron.gdn_kernels) needs flash-linear-attention "
            "(pip install 'rl-refit[fla]')",
            name="fla",
        ) from err
    return chunk_gated_delta_rule, l2norm


def _fla_rule(chunk_gated_delta_rule):
    def rule(q, k, v, g, beta, cu_seqlens):
        out, _ = chunk_gated_delta_rule(
            q,
            k,
            v,
            g=g,
            beta=beta,
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=False,
            cu_seqlens=cu_seqlens,
        )
        return out

    return rule


def fla_kernels() -> GdnKernels:
    """flash-linear-attention's Triton kernels, driven by `cu_seqlens` (GPU)."""
    chunk_gated_delta_rule, l2norm = _import_fla("fla")
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except ImportError as err:
        raise ModuleNotFoundError(
            "GdnKernels 'fla' (adapters.megatron.gdn_kernels) needs fla.modules.causal_conv1d "
            "(flash-linear-attention >= 0.6); use the 'causal_conv1d' set with older fla",
            name="fla",
        ) from err

    def conv(x, weight, bias, activation, cu_seqlens, seq_idx):
        out, _ = causal_conv1d(
            x=x,
            weight=weight,
            bias=bias,
            activation=activation,
            initial_state=None,
            output_final_state=False,
            cu_seqlens=cu_seqlens,
        )
        return out

    return GdnKernels("fla", conv, _fla_rule(chunk_gated_delta_rule), l2norm)


def causal_conv1d_kernels() -> GdnKernels:
    """causal-conv1d's `causal_conv1d_fn(seq_idx=...)` for the convolution, fla for the rule."""
    chunk_gated_delta_rule, l2norm = _import_fla("causal_conv1d")
    try:
        from causal_conv1d import causal_conv1d_fn
    except ImportError as err:
        raise ModuleNotFoundError(
            "GdnKernels 'causal_conv1d' (adapters.megatron.gdn_kernels) needs the causal-conv1d "
            "package (pip install causal-conv1d)",
            name="causal_conv1d",
        ) from err

    def conv(x, weight, bias, activation, cu_seqlens, seq_idx):
        # seq_idx needs the channel-last layout: a [B, D, T] view of a contiguous [B, T, D].
        channel_last = x.contiguous().transpose(1, 2)
        out = causal_conv1d_fn(channel_last, weight, bias, seq_idx=seq_idx, activation=activation)
        return out.transpose(1, 2)

    return GdnKernels("causal_conv1d", conv, _fla_rule(chunk_gated_delta_rule), l2norm)


_BUILDERS: dict[str, Callable[[], GdnKernels]] = {
    "reference": reference_kernels,
    "fla": fla_kernels,
    "causal_conv1d": causal_conv1d_kernels,
}


def select_kernels(choice: str | GdnKernels = "auto", device: torch.device | str | None = None) -> GdnKernels:
    """Pick a kernel set.

    `auto`: the reference kernels on CPU; on CUDA fla's kernels, or causal-conv1d's convolution
    with fla's rule when fla's varlen convolution is missing.

    Args:
        choice: "auto", "reference", "fla", "causal_conv1d", or a ready GdnKernels.
        device: where the model runs (for "auto"); default CUDA when available.

    Returns:
        The GdnKernels to inject.
    """
    if isinstance(choice, GdnKernels):
        return choice
    if choice not in KERNEL_SETS:
        raise ValueError(f"gdn kernels {choice!r} is not one of {KERNEL_SETS}")
    if choice != "auto":
        return _BUILDERS[choice]()
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type != "cuda":
        return reference_kernels()
    try:
        return fla_kernels()
    except ModuleNotFoundError as fla_missing:
        try:
            return causal_conv1d_kernels()
        except ModuleNotFoundError:
            raise fla_missing from None
