"""Bit-for-bit comparison of one weight's checkpoint tensors with vLLM's quantizer for its format."""

from __future__ import annotations

import torch

from domain.quant.codecs.elements import e2m1_values, unpack_fp4
from domain.quant.formats import FP8_BLOCK, MXFP4, MXFP8, NVFP4, PrecisionFormat
from tests.vllm import references as ref


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_nvfp4_values_equal(got: torch.Tensor, values: torch.Tensor, source: torch.Tensor, what: str) -> None:
    """E2M1 values (float32) against ref_nvfp4_quant's, bit for bit, except the sign of a zero.

    The sign of a zero is the input's sign bit, as the kernel's cvt.rn.satfinite.e2m1x2.f32 keeps
    it, where the mirror's torch.sign(x) * |q| turns a product that was -0.0 (an input of -0.0, or
    one that underflowed) into +0.
    """
    zero = values == 0
    assert torch.equal(bits(got)[~zero], bits(values)[~zero]), what
    assert bool((got[zero] == 0).all()), what
    assert torch.equal(torch.signbit(got[zero]), torch.signbit(source.float()[zero])), what


def assert_equals_vllm(fmt: PrecisionFormat, tensors: dict[str, torch.Tensor], w: torch.Tensor,
                       gs: torch.Tensor | None = None, what: str = "") -> None:
    """`tensors` (one 2-D weight's checkpoint tensors) equal vLLM's quantization of `w`.

    Args:
        fmt: the format.
        tensors: local names ("weight" / "weight_packed", "weight_scale", "weight_global_scale").
        w: the BF16 (or fp16 / fp32) source weight [N, K].
        gs: NVFP4: vLLM's global scale for the weight's group; computed from `w` when None.
        what: for messages.
    """
    if fmt.name == FP8_BLOCK.name:
        q, scale = ref.fp8_block(w)
        assert torch.equal(bits(tensors["weight_scale"]), bits(scale)), what
        assert torch.equal(bits(tensors["weight"]), bits(q)), what
    elif fmt.name == MXFP8.name:
        q, scale = ref.mxfp8(w)
        assert torch.equal(tensors["weight_scale"], scale), what
        assert torch.equal(bits(tensors["weight"]), bits(q)), what
    elif fmt.name == MXFP4.name:
        packed, scale = ref.mxfp4(w)
        assert torch.equal(tensors["weight_scale"], scale), what
        assert torch.equal(tensors["weight_packed"], packed), what
    elif fmt.name == NVFP4.name:
        gs = ref.nvfp4_global_scale(w) if gs is None else gs
        values, scale = ref.nvfp4(w, gs)
        assert torch.equal(bits(tensors["weight_global_scale"].reshape(1)), bits(gs)), what
        assert torch.equal(bits(tensors["weight_scale"].float()), bits(scale)), what
        assert_nvfp4_values_equal(e2m1_values(unpack_fp4(tensors["weight_packed"])), values, w, what)
    else:
        raise ValueError(f"{fmt.name} is not quantized")
