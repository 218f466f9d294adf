"""Compiled codec kernels are bit-identical to the eager reference, under both element rules and
both MX scale rules, for weights and activations."""

from __future__ import annotations

import pytest
import torch

from domain.quant.codecs import compile as kernels
from domain.quant.codecs import fake_quantize_activation, quantize_weight
from domain.quant.formats import FP8_BLOCK, MXFP4, MXFP8, NVFP4, ActivationScheme, ElementRule, MxScaleRule
from tests.codecs.special import special_weight


@pytest.fixture
def compiled():
    kernels.set_compiled(True)
    yield
    kernels.set_compiled(False)


@pytest.mark.slow
@pytest.mark.parametrize("numerics", list(ElementRule))
def test_compiled_kernels_are_bit_identical_to_eager(compiled, numerics) -> None:
    w2 = special_weight(200, 256, torch.bfloat16, block=16, seed=1)
    w3 = torch.randn(2, 64, 96) * 3
    cases = [(FP8_BLOCK, None), (MXFP8, MxScaleRule.RCEIL), (MXFP8, MxScaleRule.EVEN),
             (MXFP4, MxScaleRule.RCEIL), (MXFP4, MxScaleRule.EVEN), (NVFP4, None)]
    for w in (w2, w3):
        for fmt, rule in cases:
            kernels.set_compiled(True)
            fast = quantize_weight(fmt, w, numerics=numerics, scale_rule=rule).tensors
            kernels.set_compiled(False)
            ref = quantize_weight(fmt, w, numerics=numerics, scale_rule=rule).tensors
            for key in ref:
                assert torch.equal(fast[key].view(torch.uint8), ref[key].view(torch.uint8)), (fmt.name, key)
    x = special_weight(64, 256, torch.bfloat16, block=16, seed=2)
    for scheme in (ActivationScheme.FP8_GROUP_128, ActivationScheme.MXFP8, ActivationScheme.MXFP4,
                   ActivationScheme.NVFP4_PER_TOKEN):
        kernels.set_compiled(True)
        fast = fake_quantize_activation(scheme, x, numerics=numerics)
        kernels.set_compiled(False)
        ref = fake_quantize_activation(scheme, x, numerics=numerics)
        assert torch.equal(fast.view(torch.int16), ref.view(torch.int16)), scheme


def test_compiled_path_still_rejects_non_finite(compiled) -> None:
    from domain.errors import NonFiniteTensor

    w = torch.randn(4, 32)
    w[1, 1] = float("nan")
    with pytest.raises(NonFiniteTensor):
        quantize_weight(MXFP8, w)
