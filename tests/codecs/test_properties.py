"""Property-based tests: round-trip error bounds, and decode(encode(x)) == x for values that are
exactly representable with their scales."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from domain.quant.codecs import dequantize_weight, quantize_weight
from domain.quant.formats import E2M1_VALUES, FP8_BLOCK, MXFP4, MXFP8, NVFP4, MxScaleRule

_settings = settings(max_examples=40, deadline=None)


@st.composite
def weights(draw, k_multiple: int = 32):
    n = draw(st.integers(1, 6))
    k = k_multiple * draw(st.integers(1, 4))
    mags = st.one_of(st.just(0.0), st.floats(0.01, 100.0))
    vals = draw(st.lists(mags, min_size=n * k, max_size=n * k))
    signs = draw(st.lists(st.booleans(), min_size=n * k, max_size=n * k))
    x = torch.tensor([-v if s else v for v, s in zip(vals, signs, strict=True)], dtype=torch.float32)
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    return x.reshape(n, k).to(dtype)


def _unit(q, fmt) -> torch.Tensor:
    """The scale each element was divided by, broadcast to the weight's shape."""
    t = q.tensors
    if fmt is FP8_BLOCK:
        n, k = q.shape
        return t["weight_scale"].repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    if fmt is NVFP4:
        return (t["weight_scale"].float() / t["weight_global_scale"]).repeat_interleave(16, -1)
    return torch.exp2(t["weight_scale"].float() - 127).repeat_interleave(32, -1)


@_settings
@given(w=weights(), rule=st.sampled_from(list(MxScaleRule)))
def test_e4m3_formats_error_is_within_half_an_e4m3_step(w, rule) -> None:
    for fmt in (FP8_BLOCK, MXFP8):
        q = quantize_weight(fmt, w, scale_rule=rule)
        err = (dequantize_weight(q) - w.float()).abs()
        # half a step: 2^-4 relative for normals, 2^-10 units for subnormals (plus float32 slack)
        bound = w.float().abs() * 2.0**-4 + _unit(q, fmt) * 2.0**-10
        assert (err <= bound * (1 + 1e-6)).all()


@_settings
@given(w=weights(), rule=st.sampled_from(list(MxScaleRule)))
def test_e2m1_formats_error_is_within_half_an_e2m1_step(w, rule) -> None:
    for fmt in (MXFP4, NVFP4):
        q = quantize_weight(fmt, w, scale_rule=rule)
        err = (dequantize_weight(q) - w.float()).abs()
        # half a step is 0.25 units below 2 and a quarter of the value above; saturation of a
        # block maximum (e4m3-rounded NVFP4 block scales, or the `even` rule) stays below that too.
        bound = torch.maximum(w.float().abs() * 0.25, _unit(q, fmt) * 0.25)
        assert (err <= bound * (1 + 1e-6)).all()


_E4M3_GRID = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
_E4M3_GRID = _E4M3_GRID[torch.isfinite(_E4M3_GRID)]
_E2M1_GRID = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES])


def _representable(draw, grid, n, k, block, top):
    idx = draw(st.lists(st.integers(0, len(grid) - 1), min_size=n * k, max_size=n * k))
    q = grid[torch.tensor(idx)].reshape(n, k // block, block)
    q[..., 0] = top  # every block reaches the element maximum, so its scale is recomputed exactly
    return q.reshape(n, k)


@_settings
@given(data=st.data(), exp=st.integers(-20, 20), rule=st.sampled_from(list(MxScaleRule)))
def test_decode_encode_is_identity_on_representable_values(data, exp, rule) -> None:
    n, k = 3, 64
    x8 = _representable(data.draw, _E4M3_GRID, n, k, 32, 448.0) * 2.0**exp
    x4 = _representable(data.draw, _E2M1_GRID, n, k, 32, 6.0) * 2.0**exp
    if rule is MxScaleRule.RCEIL:
        assert torch.equal(dequantize_weight(quantize_weight(MXFP8, x8, scale_rule=rule)), x8)
        assert torch.equal(dequantize_weight(quantize_weight(MXFP4, x4, scale_rule=rule)), x4)
    xb = _representable(data.draw, _E4M3_GRID, 2, 128, 128, 448.0) * 2.0**exp
    assert torch.equal(dequantize_weight(quantize_weight(FP8_BLOCK, xb)), xb)
    # NVFP4 with a power-of-two global scale and an e4m3 block scale: x = code * scale / gs.
    gs = torch.tensor([2.0 ** (exp % 8)])
    block_scale = data.draw(st.sampled_from(_E4M3_GRID[(_E4M3_GRID > 2**-6) & (_E4M3_GRID < 448)].tolist()))
    xn = _representable(data.draw, _E2M1_GRID, n, k, 16, 6.0) * block_scale / gs
    assert torch.equal(dequantize_weight(quantize_weight(NVFP4, xn, global_scale=gs)), xn)
