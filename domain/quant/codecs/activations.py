"""Dynamic activation fake-quantization: what the rollout kernels do to a layer's input.

All schemes work along the last (hidden) dimension, per token, under the plan's element rule
(engine by default: the rollout's own activation kernels):
- FP8 1x128 groups: float32 scale = amax_group / 448 per 128 values (edge group allowed); the
  engine's kernel (per_token_group_quant_fp8) clamps amax to 1e-10 and divides.
- MXFP8 / MXFP4: the weights' 1x32 blocks and E8M0 exponent rule.
- NVFP4 per token, engine rule: the per-token quantizer vLLM's FlashInfer TRT-LLM experts call
  (`quantize_nvfp4_per_token_input`: FlashInfer's `nvfp4_quantize` with the base scale
  1 / (448 * 6) and `per_token_activation=True`; its CUDA kernel `nvfp4QuantAndPerTokenScaleKernel`,
  fast-math path), see `nvfp4_per_token`. Under the compressed-tensors rule (which has no per-token
  path): a global scale per token ((6 * 448) / amax_token), then the weights' block rule.
- NVFP4 static: one calibrated global scale (input_global_scale) for every token.
"""

from __future__ import annotations

import torch

from domain.errors import InvalidTensor, UnsupportedDtype
from domain.quant.codecs import fp8_block, mx, nvfp4
from domain.quant.codecs.checks import FLOAT_DTYPES, check_last_dim
from domain.quant.codecs.elements import e2m1_values, unpack_fp4
from domain.quant.formats import (
    F4E2M1_MAX,
    F8E4M3_MAX,
    FP8_BLOCK,
    MXFP4,
    MXFP8,
    NVFP4,
    ActivationScheme,
    ElementRule,
    MxScaleRule,
)

_GROUP = (1, FP8_BLOCK.block_size[1])  # one token x the weight block's K: 1 x 128
# vLLM's NVFP4_PER_TOKEN_BASE_GLOBAL_SCALE (quantization/utils/flashinfer_utils.py), which the
# kernel receives as a float32 (`float globalScaleInv`).
PER_TOKEN_BASE_GLOBAL_SCALE = 1.0 / (F8E4M3_MAX * F4E2M1_MAX)


def _per_token(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def nvfp4_per_token(x: torch.Tensor, name: str = "activation") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 activations with one FP32 decode scale per token, as vLLM's per-token NVFP4 experts
    quantize them (FlashInfer's `nvfp4QuantAndPerTokenScaleKernel`, fast-math path), ported
    expression by expression:

    - `perTokenScale = rowAmax * globalScaleInv`, globalScaleInv = float32(1 / (448 * 6));
    - `globalEncodeScale = reciprocal(perTokenScale)`;
    - per 1 x 16 block (`cvt_warp_fp16_to_fp4`): `SFValue = e4m3(globalEncodeScale * (vecMax *
      reciprocal(6)))`, elements `E2M1(x * reciprocal(SFValue * reciprocal(globalEncodeScale)))`,
      0 where the block is all zeros;
    - the GEMM decodes a token's values as `e2m1 * SFValue * perTokenScale`.

    The kernel's `rcp.approx.ftz.f32` is written as ref_nvfp4_quant writes it for vLLM's
    `scaled_fp4_quant` (the engine rule's weights): 1 / t, with t = 0 read as 1e8, so an all-zero
    token gives zeros and never NaN.

    Args:
        x: [T, H] activations (H a multiple of 16).
        name: for errors.

    Returns:
        (packed e2m1 uint8 [T, H/2], block scales e4m3 [T, H/16], per-token decode scales float32 [T, 1]).
    """
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    per_token_scale = amax * torch.tensor(PER_TOKEN_BASE_GLOBAL_SCALE, dtype=torch.float32)
    encode = nvfp4.engine_reciprocal(per_token_scale)
    packed, scale = nvfp4.quantize(x, name, encode, ElementRule.ENGINE)
    return packed, scale, per_token_scale


def nvfp4_per_token_dequantize(packed: torch.Tensor, scale: torch.Tensor, per_token_scale: torch.Tensor) -> torch.Tensor:
    """float32 [T, H] = e2m1 x block scale x per-token decode scale (what the GEMM multiplies)."""
    block = NVFP4.block_size[1]
    values = e2m1_values(unpack_fp4(packed))
    x = values.reshape(values.shape[0], -1, block) * scale.float().unsqueeze(-1)
    return (x * per_token_scale.float().unsqueeze(-1)).reshape(values.shape)


@torch.no_grad()
def _fake_quantize(
    scheme: ActivationScheme, x: torch.Tensor, global_scale: torch.Tensor | None, name: str,
    rule: ElementRule, scale_rule: MxScaleRule | None,
) -> torch.Tensor:
    t = _per_token(x)
    if scheme is ActivationScheme.FP8_GROUP_128:
        q, s = fp8_block.quantize(t, name, _GROUP, rule, activation=True)
        out = fp8_block.dequantize(q, s, _GROUP)
    elif scheme in (ActivationScheme.MXFP8, ActivationScheme.MXFP4):
        fmt = MXFP8 if scheme is ActivationScheme.MXFP8 else MXFP4
        check_last_dim(t, name, k_multiple=fmt.k_multiple, fmt_name=scheme.value)
        elements, scale = mx.quantize(t, name, fmt, rule, scale_rule)
        out = mx.dequantize(elements, scale, fmt)
    elif scheme in (ActivationScheme.NVFP4_PER_TOKEN, ActivationScheme.NVFP4_STATIC):
        check_last_dim(t, name, k_multiple=NVFP4.k_multiple, fmt_name=scheme.value)
        if scheme is ActivationScheme.NVFP4_PER_TOKEN and rule is ElementRule.ENGINE:
            return nvfp4_per_token_dequantize(*nvfp4_per_token(t, name)).reshape(x.shape).to(x.dtype)
        if scheme is ActivationScheme.NVFP4_PER_TOKEN:
            gs = nvfp4.global_scale(t.unsqueeze(-2), name=name, rule=rule)  # [T, 1]: one per token
        elif global_scale is None:
            raise InvalidTensor(name, "static NVFP4 activations need a calibrated input_global_scale",
                                "pass global_scale, or use the nvfp4_per_token scheme")
        else:
            gs = global_scale.float().reshape(1, 1)
        packed, scale = nvfp4.quantize(t, name, gs, rule)
        out = nvfp4.dequantize(packed, scale, gs)
    else:
        return x
    return out.reshape(x.shape).to(x.dtype)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scheme, global_scale, name, rule, scale_rule):
        return _fake_quantize(scheme, x, global_scale, name, rule, scale_rule)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None, None, None


def fake_quantize_activation(
    scheme: ActivationScheme,
    x: torch.Tensor,
    *,
    global_scale: torch.Tensor | None = None,
    name: str = "activation",
    numerics: ElementRule = ElementRule.ENGINE,
    scale_rule: MxScaleRule | None = None,
) -> torch.Tensor:
    """Quantize-dequantize an activation [..., H] the way the rollout's kernels quantize it.

    Args:
        scheme: the activation scheme (NONE returns x unchanged).
        x: activations in bfloat16, float16 or float32; the last dimension is the hidden one.
        global_scale: the calibrated input_global_scale, for NVFP4_STATIC only.
        name: for errors.
        numerics: the element rule (the plan's `numerics`).
        scale_rule: MX only: the exponent rule; None = the format's rule under `numerics`.

    Returns:
        A tensor like x. Gradients pass straight through (the identity), for QAT.
    """
    if scheme is ActivationScheme.NONE:
        return x
    if x.dtype not in FLOAT_DTYPES:
        raise UnsupportedDtype(name, f"dtype {x.dtype} cannot be quantized", "pass a floating tensor")
    return _StraightThrough.apply(x, scheme, global_scale, name, numerics, scale_rule)
