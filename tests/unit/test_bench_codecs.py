"""`refit bench codecs` without timing anything: the share verdicts against each preset's target,
and the stage profile's stages, whose last one is the codec's own kernel."""

from __future__ import annotations

import pytest
import torch

from app.bench.codec_stages import stages
from app.bench.codecs import TARGETS, _share_note
from domain.quant.codecs import compile as kernels
from domain.quant.codecs import quantize_weight
from domain.quant.formats import FP8_BLOCK, MXFP4, MXFP8, NVFP4


def test_share_notes_hold_each_preset_to_its_target() -> None:
    assert TARGETS == {"FP8_BLOCK": 0.25, "MXFP8": 0.25, "MXFP4": 0.10, "NVFP4": 0.10}
    assert _share_note(FP8_BLOCK, 0.3).endswith("reaches 30% of the copy_ bound measured in turns with it (target 25%: met)")
    assert _share_note(MXFP8, 0.2).endswith("(target 25%: NOT met)")
    assert _share_note(NVFP4, 0.12).endswith("(target 10%: met)")


@pytest.mark.parametrize("fmt", [FP8_BLOCK, MXFP8, MXFP4, NVFP4], ids=lambda f: f.name)
def test_the_last_stage_is_the_codecs_kernel(fmt) -> None:
    w = (torch.randn(128, 256, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    steps = stages(fmt)
    assert list(steps)[:3] == ["block amax", "+ scale rule", "+ element rounding"]
    for step in steps.values():
        step(w)  # every stage runs
    elements, scale, _ = list(steps.values())[-1](w)
    with kernels.use(kernels.CodecPath.EAGER):
        ref = quantize_weight(fmt, w, global_scale=torch.ones(1) if fmt is NVFP4 else None).tensors
    assert torch.equal(elements.view(torch.uint8), ref[fmt.weight_name].view(torch.uint8))
    expected = ref["weight_scale"]
    assert torch.equal(scale.reshape(expected.shape).contiguous().view(torch.uint8),
                       expected.contiguous().view(torch.uint8))
