"""pytest wrapper of check_modelopt_qat.py: ModelOpt QAT on CUDA (NVFP4, MX, FP8 block) vs the exporter."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("preset", ["FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4"])
@pytest.mark.parametrize("numerics", ["exporter", "modelopt"])
def test_modelopt_qat_on_cuda(preset: str, numerics: str) -> None:
    pytest.importorskip("modelopt.torch.quantization", reason="needs nvidia-modelopt (the `modelopt` extra)")
    from tests.gpu.check_modelopt_qat import check_one

    for model in ("tiny", "big"):
        result = check_one(preset, numerics, model)
        assert result["ok"], result
