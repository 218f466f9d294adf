"""The `compressed-tensors` element rule against the compressed-tensors that vLLM installs (0.17),
on the same test matrix, bit for bit: what llm-compressor would have written."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (.venv-vllm), which `make test` creates")

import torch

from domain.quant.codecs import nvfp4_global_scale, quantize_weight
from domain.quant.formats import FORMATS, FP8_BLOCK, MXFP4, MXFP8, NVFP4, ElementRule
from tests.codecs import ct_reference
from tests.codecs.matrix import cases, fused_group
from tests.vllm.compare import bits

CT = ElementRule.COMPRESSED_TENSORS
# compressed-tensors' compressor takes whole blocks only: no edge blocks.
MATRIX = [(f.name, name, w) for f in (FP8_BLOCK, MXFP8, MXFP4, NVFP4) for name, w in cases(f).items()
          if not name.startswith("edge")]


@pytest.mark.parametrize(("preset", "case", "w"), MATRIX, ids=[f"{p}-{c}" for p, c, _ in MATRIX])
def test_the_matrix_equals_compressed_tensors(preset: str, case: str, w: torch.Tensor) -> None:
    fmt = FORMATS[preset]
    ours = quantize_weight(fmt, w, numerics=CT).tensors
    for e, one in enumerate(list(w) if w.dim() == 3 else [w]):
        want = ct_reference.quantize(fmt, one)
        for key, t in want.items():
            got = ours[key][e] if w.dim() == 3 else ours[key]
            assert torch.equal(bits(got.reshape(t.shape).to(t.dtype) if key == "weight_global_scale" else got),
                               bits(t)), (case, e, key)


def test_fused_group_equals_compressed_tensors() -> None:
    group = fused_group()
    gs = nvfp4_global_scale(*group.values(), numerics=CT)
    assert torch.equal(gs, ct_reference.global_scale(*group.values()))
    for name, w in group.items():
        ours = quantize_weight(NVFP4, w, global_scale=gs, numerics=CT).tensors
        want = ct_reference.quantize(NVFP4, w, gs)
        assert torch.equal(ours["weight_packed"], want["weight_packed"]), name
        assert torch.equal(bits(ours["weight_scale"]), bits(want["weight_scale"])), name
