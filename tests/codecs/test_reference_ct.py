"""Codecs under the `compressed-tensors` element rule against compressed-tensors' own functions,
bit for bit: NVFP4 (generate_gparam, calculate_qparams, the NVFP4 compressor), MX "even"
(calculate_qparams and the MXFP8 / MXFP4 compressors), FP8 block (calculate_qparams, block
strategy, the float compressor)."""

from __future__ import annotations

import pytest
import torch

from domain.quant.codecs import dequantize_weight, nvfp4_global_scale, quantize_weight
from domain.quant.formats import FORMATS, FP8_BLOCK, MXFP4, MXFP8, NVFP4, ElementRule, MxScaleRule
from tests.codecs.special import special_weight

ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors is the reference")
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.mxfp8.base import MXFP8QuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402

from tests.codecs import ct_reference  # noqa: E402
from tests.codecs.ct_reference import group_minmax as _group_minmax  # noqa: E402
from tests.codecs.ct_reference import scheme as _scheme  # noqa: E402
from tests.codecs.matrix import cases, fused_group  # noqa: E402

CT = ElementRule.COMPRESSED_TENSORS
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(33, 64), (48, 96), (7, 160)]


def _ct_nvfp4(w: torch.Tensor, gs: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    return ct_reference.quantize(NVFP4, w, gs)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _matrix() -> list[tuple[str, str, torch.Tensor]]:
    return [(f.name, name, w) for f in (FP8_BLOCK, MXFP8, MXFP4, NVFP4) for name, w in cases(f).items()
            if not name.startswith("edge")]  # compressed-tensors' compressor takes whole blocks only


@pytest.mark.parametrize(("preset", "case", "w"), _matrix(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_matrix_equals_compressed_tensors_under_its_rule(preset: str, case: str, w: torch.Tensor) -> None:
    fmt = FORMATS[preset]
    weights = list(w) if w.dim() == 3 else [w]
    ours = quantize_weight(fmt, w, numerics=CT).tensors
    for e, one in enumerate(weights):
        ref = ct_reference.quantize(fmt, one)
        mine = {key: t[e] if w.dim() == 3 else t for key, t in ours.items()}
        for key, want in ref.items():
            if key == "weight_global_scale":
                assert torch.equal(mine[key].float().reshape(-1), want.float().reshape(-1)), (case, e, key)
            else:
                assert torch.equal(_bits(mine[key]), _bits(want)), (case, e, key)


def test_fused_group_equals_compressed_tensors_under_its_rule() -> None:
    group = fused_group()
    gs = nvfp4_global_scale(*group.values(), numerics=CT)
    ref_gs = ct_reference.global_scale(*group.values())
    assert torch.equal(gs, ref_gs)
    for w in group.values():
        ours = quantize_weight(NVFP4, w, global_scale=gs, numerics=CT).tensors
        ref = ct_reference.quantize(NVFP4, w, ref_gs)
        assert torch.equal(ours["weight_packed"], ref["weight_packed"])
        assert torch.equal(_bits(ours["weight_scale"]), _bits(ref["weight_scale"]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_nvfp4_matches_compressed_tensors_bitwise(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    w = special_weight(*shape, dtype, block=16, seed=shape[0])
    ours = quantize_weight(NVFP4, w, numerics=CT).tensors
    ref = _ct_nvfp4(w)
    assert torch.equal(ours["weight_global_scale"], ref["weight_global_scale"].float())
    assert torch.equal(ours["weight_scale"].view(torch.uint8), ref["weight_scale"].view(torch.uint8))
    assert torch.equal(ours["weight_packed"], ref["weight_packed"])


def test_nvfp4_shared_global_scale_matches_compressed_tensors() -> None:
    q = torch.randn(64, 32, dtype=torch.bfloat16)
    k = torch.randn(32, 32, dtype=torch.bfloat16) * 3
    v = torch.randn(32, 32, dtype=torch.bfloat16) * 0.1
    gs = nvfp4_global_scale(q, k, v, numerics=CT)
    fused = torch.cat([q, k, v]).float()
    ref_gs = generate_gparam(fused.amin().reshape(1), fused.amax().reshape(1))
    assert torch.equal(gs, ref_gs)
    for w in (q, k, v):
        ours = quantize_weight(NVFP4, w, global_scale=gs, numerics=CT).tensors
        ref = _ct_nvfp4(w, ref_gs)
        assert torch.equal(ours["weight_packed"], ref["weight_packed"])
        assert torch.equal(ours["weight_scale"].view(torch.uint8), ref["weight_scale"].view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_dequantize_matches_compressed_tensors(dtype: torch.dtype) -> None:
    w = special_weight(40, 64, dtype, block=16, seed=3)
    q = quantize_weight(NVFP4, w, numerics=CT)
    ref = NVFP4PackedCompressor.decompress(dict(q.tensors), _scheme("NVFP4"))["weight"]
    assert torch.equal(dequantize_weight(q, torch.bfloat16), ref.to(torch.bfloat16))


def test_nvfp4_zero_tensor_has_finite_scales() -> None:
    q = quantize_weight(NVFP4, torch.zeros(16, 32), numerics=CT)
    assert q.tensors["weight_global_scale"].item() == 1.0
    assert torch.isfinite(q.tensors["weight_scale"].float()).all()
    assert torch.equal(dequantize_weight(q), torch.zeros(16, 32))


@pytest.mark.parametrize(("fmt", "preset", "compressor"), [
    (MXFP8, "MXFP8", MXFP8QuantizationCompressor),
    (MXFP4, "MXFP4", MXFP4PackedCompressor),
])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_mx_even_matches_compressed_tensors_bitwise(fmt, preset, compressor, dtype, shape) -> None:
    w = special_weight(*shape, dtype, block=32, seed=shape[1])
    scheme = _scheme(preset)
    mn, mx = _group_minmax(w, 32)
    scale, _ = calculate_qparams(mn, mx, scheme.weights)
    ref = compressor.compress({"weight": w, "weight_scale": scale}, scheme)
    ours = quantize_weight(fmt, w, numerics=CT, scale_rule=MxScaleRule.EVEN).tensors
    assert torch.equal(ours["weight_scale"], ref["weight_scale"])
    if fmt is MXFP8:
        assert torch.equal(ours["weight"].view(torch.uint8), ref["weight"].view(torch.uint8))
    else:
        assert torch.equal(ours["weight_packed"], ref["weight_packed"])


@pytest.mark.parametrize(("fmt", "preset", "compressor"), [
    (MXFP8, "MXFP8", MXFP8QuantizationCompressor),
    (MXFP4, "MXFP4", MXFP4PackedCompressor),
])
def test_mx_dequantize_matches_compressed_tensors(fmt, preset, compressor) -> None:
    w = special_weight(24, 64, torch.float32, block=32, seed=5)
    q = quantize_weight(fmt, w, numerics=CT, scale_rule=MxScaleRule.EVEN)
    ref = compressor.decompress(dict(q.tensors), _scheme(preset))["weight"]
    assert torch.equal(dequantize_weight(q, torch.bfloat16), ref.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_block_scales_match_compressed_tensors(dtype: torch.dtype) -> None:
    w = special_weight(200, 300, dtype, block=128, seed=7)
    scheme = _scheme("FP8_BLOCK")
    wf = torch.nn.functional.pad(w.float(), (0, 384 - 300, 0, 256 - 200))
    blocks = wf.reshape(2, 128, 3, 128)
    scale, _ = calculate_qparams(blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3)), scheme.weights)
    ours = quantize_weight(FP8_BLOCK, w, numerics=CT).tensors["weight_scale"]
    assert ours.dtype == torch.float32
    assert torch.equal(ours, scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_block_matches_the_float_compressor_bitwise(dtype: torch.dtype) -> None:
    w = special_weight(256, 384, dtype, block=128, seed=3)
    scheme = _scheme("FP8_BLOCK")
    blocks = w.float().reshape(2, 128, 3, 128)
    scale, _ = calculate_qparams(blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3)), scheme.weights)
    ref = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    q = quantize_weight(FP8_BLOCK, w, numerics=CT)
    assert torch.equal(q.tensors["weight"].view(torch.uint8), ref["weight"].view(torch.uint8))
    assert torch.equal(q.tensors["weight_scale"], ref["weight_scale"])
    back = FloatQuantizationCompressor.decompress(dict(q.tensors), scheme)["weight"]
    assert torch.equal(dequantize_weight(q, back.dtype), back)
