"""Stored-quantized modules are recognised by their exact tensors and decode to what the codecs'
dequantize_weight gives; anything else quantized is reported, and BF16 modules are left alone."""

from __future__ import annotations

import pytest
import torch

from domain.quant.codecs import dequantize_weight, quantize_weight
from domain.quant.formats import FP8_BLOCK, MXFP4, MXFP8, NVFP4
from domain.quant.stored import decode, find_stored

M = "model.layers.0.mlp.down_proj"


def _stored(fmt, scale_name: str = "weight_scale") -> tuple[dict[str, torch.Tensor], torch.Tensor]:  # type: ignore[no-untyped-def]
    w = torch.randn(96, 160, generator=torch.Generator().manual_seed(1))
    q = quantize_weight(fmt, w)
    tensors = {f"{M}.{scale_name if k == 'weight_scale' else k}": t for k, t in q.tensors.items()}
    return tensors, dequantize_weight(q)


@pytest.mark.parametrize("fmt", [FP8_BLOCK, MXFP8, MXFP4, NVFP4], ids=lambda f: f.name)
@pytest.mark.parametrize("scale_name", ["weight_scale", "weight_scale_inv"])
def test_every_preset_is_recognised_and_decoded(fmt, scale_name: str) -> None:  # type: ignore[no-untyped-def]
    tensors, expected = _stored(fmt, scale_name)
    specs = [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    specs.append(("model.layers.0.mlp.up_proj.weight", (96, 160), torch.bfloat16))  # a BF16 module
    found = find_stored(specs)
    assert list(found) == [M]
    assert found[M].format is fmt and found[M].shape == (96, 160) and found[M].scale_name == scale_name
    assert torch.equal(decode(found[M], tensors, torch.float32), expected)


def test_e8m0_scales_are_read_as_their_bytes() -> None:
    if not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip("this torch has no float8_e8m0fnu")
    tensors, expected = _stored(MXFP4)
    tensors[f"{M}.weight_scale"] = tensors[f"{M}.weight_scale"].view(torch.float8_e8m0fnu)
    found = find_stored([(n, tuple(t.shape), t.dtype) for n, t in tensors.items()])
    assert found[M].format is MXFP4 and torch.equal(decode(found[M], tensors, torch.float32), expected)


@pytest.mark.parametrize("specs", [
    [(f"{M}.weight_packed", (96, 20), torch.int32), (f"{M}.weight_scale", (96, 5), torch.bfloat16)],  # int4 packing
    [(f"{M}.qweight", (20, 96), torch.int32), (f"{M}.scales", (5, 96), torch.float16)],  # GPTQ
    [(f"{M}.weight", (96, 160), torch.float8_e4m3fn)],  # FP8 without its scale
    [(f"{M}.weight", (96, 160), torch.float8_e4m3fn), (f"{M}.weight_scale", (1,), torch.float32)],  # per-tensor FP8
], ids=["int4", "gptq", "fp8 without scale", "per-tensor fp8"])
def test_other_quantized_layouts_are_reported_not_decoded(specs: list) -> None:
    found = find_stored(specs)
    assert list(found) == [M] and found[M].format is None and found[M].found
