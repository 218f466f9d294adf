"""vLLM's own quantizers as references (vLLM 0.32, the `.venv-vllm` environment).

Where vLLM's function runs on CPU it is called as is:
- FP8_BLOCK weights: `vllm.utils.deep_gemm.per_block_cast_to_fp8` (deep_gemm.py:984), what
  `Fp8PerBlockOnlineLinearMethod` quantizes BF16 weights with;
- NVFP4: `ref_nvfp4_quant` (nvfp4_emulation_utils.py:640), vLLM's torch mirror of the
  `scaled_fp4_quant` CUDA kernel (that kernel needs SM100), with the global scale vLLM's online
  NVFP4 computes (`_quantize_moe_weight_to_nvfp4`, online/nvfp4.py:40): (6 * 448) /
  max(amax, 1e-8), with vLLM's own constants and `weight_amax`;
- MXFP8: `mxfp8_e4m3_quantize` (mxfp8_utils.py:222), which on CPU (and on GPUs without
  FlashInfer's SM100 kernel) is `_mxfp8_e4m3_quantize_torch` (mxfp8_utils.py:38);
- FP8 1x128 activations: `QuantFP8.forward_native` (input_quant_fp8.py:233), the torch version
  of `per_token_group_quant_fp8`, on groups whose amax is at least 1/512: below that its scale
  floor, 1 / (448 * 512), differs from the CUDA kernel's (amax floored at 1e-10), which is
  ported below.

Where vLLM's function runs only on GPU, its expressions are ported here, literally, in plain
torch, and the GPU check (tests/gpu/check_engine_quantizers.py) compares the real kernels:
- MXFP4: `mxfp4_quantize` -> the Triton kernel `_compute_quant_and_scale` (mxfp4_utils.py:228);
- FP8 1x128 activations: the CUDA kernel of `per_token_group_quant_fp8` (csrc/quantization/w8a8/
  fp8/per_token_group_quant.cu, ComputeGroupScale and QuantizeGroup, vLLM main).
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
from vllm.model_executor.layers.quantization.online.nvfp4 import FLOAT8_E4M3_MAX
from vllm.model_executor.layers.quantization.utils.mxfp8_utils import mxfp8_e4m3_quantize
from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
    FLOAT4_E2M1_MAX,
    ref_nvfp4_quant,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape, weight_amax
from vllm.utils.deep_gemm import per_block_cast_to_fp8

__all__ = [
    "fp8_block",
    "fp8_group_activation_kernel",
    "fp8_group_activation_native",
    "mxfp4",
    "mxfp8",
    "nvfp4",
    "nvfp4_global_scale",
]

_U32 = 0xFFFFFFFF


def fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """per_block_cast_to_fp8 on a 2-D weight: (e4m3 [N, K], float32 [N/128, K/128])."""
    return per_block_cast_to_fp8(w)


def nvfp4_global_scale(*tensors: torch.Tensor) -> torch.Tensor:
    """vLLM's online NVFP4 global scale over `tensors` (a fused group's shared maximum), float32 [1]."""
    amax = torch.stack([weight_amax(t.flatten()).to(torch.float32) for t in tensors]).amax()
    amax = amax.clamp_min(1e-8)
    return ((FLOAT4_E2M1_MAX * FLOAT8_E4M3_MAX) / amax).reshape(1)


def nvfp4(w: torch.Tensor, gs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ref_nvfp4_quant on a 2-D weight: E2M1 values as float32 [N, K], block scales float32 [N, K/16]."""
    return ref_nvfp4_quant(w, gs, 16)


def mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mxfp8_e4m3_quantize: (e4m3 like w, uint8 exponents [..., K/32])."""
    return mxfp8_e4m3_quantize(w)


def fp8_group_activation_native(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """QuantFP8(dynamic, 1x128 groups).forward_native: (e4m3 [T, H], float32 [T, H/128])."""
    return QuantFP8(static=False, group_shape=GroupShape(1, 128), use_ue8m0=False).forward_native(x)


def fp8_group_activation_kernel(x: torch.Tensor, eps: float = 1e-10) -> tuple[torch.Tensor, torch.Tensor]:
    """The per_token_group_quant_fp8 CUDA kernel's expressions, float scales (not UE8M0).

    `local_absmax = eps; local_absmax = fmaxf(local_absmax, fabsf(x))` over the group;
    `y_s = local_absmax / max_8bit`; `q = fminf(fmaxf(x / y_s, min_8bit), max_8bit)`.
    """
    g = x.float().reshape(x.shape[0], -1, 128)
    absmax = torch.clamp(g.abs().amax(-1, keepdim=True), min=eps)
    y_s = absmax / 448.0
    q = torch.clamp(g / y_s, -448.0, 448.0).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), y_s.squeeze(-1)


def mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel behind vLLM's `mxfp4_quantize`, ported expression by expression.

    Returns:
        (packed uint8 [..., K/2], uint8 exponents [..., K/32]).
    """
    f32 = x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    max_val = f32.abs().amax(-1, keepdim=True)
    # Round-to-nearest-even block scale (OCP MX): 2 ** (floor(log2(rounding(max_abs))) - max_exp).
    max_bits = (max_val.view(torch.int32).to(torch.int64) + 0x200000) & 0x7F800000
    max_val = max_bits.to(torch.int32).view(torch.float32)
    eps = torch.where(max_val == 0.0, 2.0**-126, 0.0)
    unbiased = torch.floor(torch.log2(max_val + eps)) - 2
    unbiased = torch.clamp(unbiased, min=-127, max=127)
    dequant = torch.exp2(unbiased)
    exponent_bits = dequant.view(torch.int32).to(torch.int64) & _U32
    quant_scale = torch.where(dequant == 0, 0.0, 1.0 / dequant)
    quant = (f32 * quant_scale).reshape(x.shape)
    scale = (exponent_bits >> 23).to(torch.uint8).squeeze(-1)
    bits = quant.view(torch.int32).to(torch.int64) & _U32
    signs = bits & 0x80000000
    exponents = (bits >> 23) & 0xFF
    mantissas = bits & 0x7FFFFF
    # Denormals of e2m1 (|q| < 1): the implicit bit moves into the mantissa; bits shifted out
    # are OR-reduced into the LSB as a sticky bit.
    adjusted = (127 - (exponents + 1)).clamp(0, 31)  # a uint32 shift of 32 or more gives 0
    folded = 0x400000 | (mantissas >> 1)
    denormal = folded >> adjusted
    denormal = denormal | ((denormal << adjusted) != folded).to(torch.int64)
    mantissas = torch.where(exponents < 127, denormal, mantissas)
    exponents = torch.maximum(exponents, torch.tensor(126)) - 126
    rounding_bias = ((mantissas >> 22) & 1) + 0x1FFFFF
    rounded = (mantissas + rounding_bias) >> 22
    e2m1 = torch.minimum((exponents << 1) + rounded, torch.tensor(7))
    value = ((signs >> 28) | e2m1).to(torch.uint8)
    pairs = value.reshape(*value.shape[:-1], value.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4), scale
