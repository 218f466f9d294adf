"""The compiled fast path gives the bytes of the eager reference.

Three levels, cheapest first: the float E2M1 encoder against the reference encoder on every float32
whose low 16 bits are one of six patterns (every rounding midpoint and its neighbours, both
signs); the kernels with the fast encoders run eagerly against the reference kernels on the
adversarial blocks, under both element rules and both MX scale rules; and the compiled path end
to end, one small shape per format (compiling is slow to warm up), on the adversarial blocks and
random tensors. tests/codecs/test_compiled.py covers the other rules and the activations.
"""

from __future__ import annotations

import pytest
import torch

from domain.quant.codecs import compile as kernels
from domain.quant.codecs import elements, fast_elements, mx, nvfp4, quantize_weight
from domain.quant.formats import FP8_BLOCK, MXFP4, MXFP8, NVFP4, ElementRule, ElementType, MxScaleRule
from tests.codecs.matrix import exact_ties, tiny_blocks
from tests.codecs.special import signed_zeros_and_decades, special_weight

_LOW_BITS = (0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF)


def _every_midpoint() -> torch.Tensor:
    high = torch.arange(0, 2**16, dtype=torch.int64) << 16
    bits = (high[:, None] | torch.tensor(_LOW_BITS)[None, :]).reshape(-1)
    values = (bits - (bits >= 2**31) * 2**32).to(torch.int32).view(torch.float32)
    return values[torch.isfinite(values)]


def _adversarial(fmt) -> dict[str, torch.Tensor]:
    """Two bf16 [128, 256] weights: the format's exact ties, and zero / subnormal / special blocks,
    signed zeros and 5 decades in one."""
    mixed = torch.cat([special_weight(32, 256, torch.float32, block=16, seed=1), tiny_blocks(32, 256, 2),
                       signed_zeros_and_decades(64, 256, seed=3)])
    return {"ties": exact_ties(fmt, 128, 256, 4), "mixed": mixed.to(torch.bfloat16),
            "random": (torch.randn(128, 256, generator=torch.Generator().manual_seed(5)) * 3).to(torch.bfloat16)}


@pytest.mark.parametrize("signed_zero", [True, False])
def test_float_e2m1_encoder_equals_reference_on_every_midpoint(signed_zero) -> None:
    x = _every_midpoint().clamp(-6.0, 6.0)
    x = torch.cat([x, torch.tensor([0.0, -0.0, -1e-30, 1e-30])])
    ref = elements.e2m1_codes(x, signed_zero=signed_zero)
    fast = fast_elements.e2m1_codes(x, signed_zero=signed_zero).to(torch.uint8)
    assert torch.equal(fast, ref)
    pairs = x[: x.numel() // 2 * 2].reshape(-1, 2)
    ref_packed = elements.pack_fp4(elements.e2m1_codes(pairs, signed_zero=signed_zero))
    assert torch.equal(fast_elements.pack_fp4(fast_elements.e2m1_codes(pairs, signed_zero=signed_zero)), ref_packed)


def _kernel_calls(w: torch.Tensor, numerics: ElementRule):
    """(what, kernel, args) of every FP4 kernel variant on `w`; the kernels take `fast` last."""
    for scale_rule in MxScaleRule:
        yield f"MXFP4 {scale_rule.value}", mx._quantize_kernel, (w, ElementType.E2M1, 32, scale_rule, numerics)
    yield "NVFP4", nvfp4._quantize_kernel, (w, nvfp4.global_scale(w, rule=numerics), 16, numerics)


@pytest.mark.parametrize("numerics", list(ElementRule))
def test_fast_kernels_run_eagerly_equal_reference_kernels(numerics) -> None:
    for fmt in (MXFP4, NVFP4):
        for name, w in _adversarial(fmt).items():
            for what, kernel, args in _kernel_calls(w, numerics):
                for ref, fast in zip(kernel(*args, False), kernel(*args, True), strict=True):
                    assert torch.equal(ref.view(torch.uint8), fast.view(torch.uint8)), (what, name)


@pytest.fixture
def compiled():
    kernels.set_compiled(True)
    yield
    kernels.set_compiled(False)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [FP8_BLOCK, MXFP8, MXFP4, NVFP4], ids=lambda f: f.name)
def test_compiled_path_bytes_equal_eager_on_adversarial_blocks(compiled, fmt) -> None:
    for name, w in _adversarial(fmt).items():
        fast = quantize_weight(fmt, w).tensors
        with kernels.use(kernels.CodecPath.EAGER):
            ref = quantize_weight(fmt, w).tensors
        assert fast.keys() == ref.keys()
        for key in ref:
            assert torch.equal(fast[key].view(torch.uint8), ref[key].view(torch.uint8)), (fmt.name, name, key)


def test_use_restores_the_previous_path() -> None:
    assert kernels.current() is kernels.CodecPath.EAGER
    with kernels.use(kernels.CodecPath.COMPILED):
        assert kernels.current() is kernels.CodecPath.COMPILED
        with kernels.use(kernels.CodecPath.EAGER):
            assert kernels.current() is kernels.CodecPath.EAGER
        assert kernels.current() is kernels.CodecPath.COMPILED
    assert kernels.current() is kernels.CodecPath.EAGER
