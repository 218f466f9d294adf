"""Bad input gets a typed error naming the tensor; nothing is returned half-done."""

from __future__ import annotations

import pytest
import torch

from domain.errors import (
    BlockMisaligned,
    InvalidTensor,
    NonFiniteTensor,
    RefitError,
    UnsupportedDtype,
    UnsupportedShape,
)
from domain.quant.codecs import fake_quantize_activation, quantize_weight
from domain.quant.formats import FP8_BLOCK, MXFP4, MXFP8, NVFP4, ActivationScheme

ALL = [FP8_BLOCK, MXFP8, MXFP4, NVFP4]


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_rejected(fmt, bad) -> None:
    w = torch.randn(8, 64)
    w[3, 17] = bad
    with pytest.raises(NonFiniteTensor, match=r"layers\.3\.mlp\.down_proj\.weight"):
        quantize_weight(fmt, w, name="layers.3.mlp.down_proj.weight")


@pytest.mark.parametrize(("fmt", "k"), [(MXFP8, 48), (MXFP4, 40), (NVFP4, 24)])
def test_k_not_a_multiple_of_the_block_is_rejected(fmt, k) -> None:
    with pytest.raises(BlockMisaligned, match=r"q_proj.weight.*ignore") as info:
        quantize_weight(fmt, torch.randn(4, k), name="q_proj.weight")
    assert isinstance(info.value, ValueError) and isinstance(info.value, RefitError)


def test_fp8_block_accepts_edge_blocks() -> None:
    assert quantize_weight(FP8_BLOCK, torch.randn(5, 7)).tensors["weight_scale"].shape == (1, 1)


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("shape", [(64,), (2, 2, 2, 64)])
def test_wrong_rank_is_rejected(fmt, shape) -> None:
    with pytest.raises(UnsupportedShape, match=r"norm\.weight"):
        quantize_weight(fmt, torch.randn(*shape), name="norm.weight")


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.float8_e4m3fn])
def test_unsupported_dtypes_are_rejected(dtype) -> None:
    with pytest.raises(UnsupportedDtype, match="w1") as info:
        quantize_weight(MXFP8, torch.zeros(4, 64).to(dtype), name="w1")
    assert isinstance(info.value, TypeError)


def test_nvfp4_global_scale_of_wrong_shape_is_rejected() -> None:
    with pytest.raises(InvalidTensor, match="global scale"):
        quantize_weight(NVFP4, torch.randn(2, 4, 32), global_scale=torch.ones(1))


def test_bf16_is_not_a_codec() -> None:
    from domain.quant.formats import BF16

    with pytest.raises(ValueError, match="not a quantized format"):
        quantize_weight(BF16, torch.randn(4, 32))


def test_static_nvfp4_activations_need_a_calibrated_scale() -> None:
    with pytest.raises(InvalidTensor, match="input_global_scale"):
        fake_quantize_activation(ActivationScheme.NVFP4_STATIC, torch.randn(2, 32))
