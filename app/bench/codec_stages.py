"""Where each codec's compiled time goes, stage by stage, for `refit bench codecs`.

Each stage is the kernel cut after one more step, compiled on its own: block amax; plus the scale
rule; plus the element rounding (the elements unpacked, uncropped); the whole kernel (plus FP4
nibble packing and the layout). The time a step adds is the difference between consecutive
stages, measured in turns on one chunk of the compiled path's size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from app.bench.report import measure_interleaved
from domain.quant.codecs import fast_elements, fp8_block, mx, nvfp4
from domain.quant.codecs.elements import to_e4m3
from domain.quant.formats import (
    E8M0_EXPONENT_BIAS,
    F4E2M1_MAX,
    F8E4M3_MAX,
    FP8_BLOCK,
    NVFP4,
    ElementRule,
    ElementType,
    MxScaleRule,
    PrecisionFormat,
)

Stage = Callable[[torch.Tensor], object]
_ENGINE = ElementRule.ENGINE


def _fp8_stages() -> dict[str, Stage]:
    block = FP8_BLOCK.block_size

    def amax(w: torch.Tensor) -> torch.Tensor:
        return fp8_block._blocked(w.float(), block).abs().amax(dim=(-3, -1))

    def scale(w: torch.Tensor) -> torch.Tensor:
        return amax(w).clamp(min=fp8_block.WEIGHT_AMAX_FLOOR) / F8E4M3_MAX

    def rounded(w: torch.Tensor) -> torch.Tensor:
        return to_e4m3(fp8_block._blocked(w.float(), block) * (1.0 / scale(w)[:, None, :, None]))

    return {"block amax": amax, "+ scale rule": scale, "+ element rounding": rounded,
            "whole kernel (+ layout)": lambda w: fp8_block._quantize_kernel(w, block, _ENGINE, False, True)}


def _mx_stages(fmt: PrecisionFormat) -> dict[str, Stage]:
    element, block = fmt.element, fmt.block_size[1]
    rule = fmt.scale_rule(_ENGINE, None) or MxScaleRule.RCEIL

    def blocks(w: torch.Tensor) -> torch.Tensor:
        return w.float().reshape(*w.shape[:-1], w.shape[-1] // block, block)

    def amax(w: torch.Tensor) -> torch.Tensor:
        return blocks(w).abs().amax(dim=-1, keepdim=True)

    def scale(w: torch.Tensor) -> torch.Tensor:
        a = amax(w)
        return mx.e8m0_rceil(a, element.max) if rule is MxScaleRule.RCEIL else mx.e8m0_even(a, element.emax)

    def rounded(w: torch.Tensor) -> torch.Tensor:
        scaled = (blocks(w) / torch.exp2((scale(w) - E8M0_EXPONENT_BIAS).float())).clamp(-element.max, element.max)
        if element is ElementType.E4M3:
            return to_e4m3(scaled)
        return fast_elements.e2m1_codes(scaled, signed_zero=True).to(torch.uint8)

    return {"block amax": amax, "+ scale rule": scale, "+ element rounding": rounded,
            "whole kernel (+ packing, layout)": lambda w: mx._quantize_kernel(w, element, block, rule, _ENGINE, True)}


def _nvfp4_stages() -> dict[str, Stage]:
    block = NVFP4.block_size[1]
    gs = torch.ones(1)

    def blocks(w: torch.Tensor) -> torch.Tensor:
        return w.float().reshape(*w.shape[:-1], w.shape[-1] // block, block)

    def amax(w: torch.Tensor) -> torch.Tensor:
        return blocks(w).abs().amax(dim=-1, keepdim=True)

    def scale(w: torch.Tensor) -> torch.Tensor:
        return to_e4m3(gs * (amax(w) * (1 / F4E2M1_MAX))).float()

    def rounded(w: torch.Tensor) -> torch.Tensor:
        scaled = (blocks(w) * nvfp4._reciprocal(scale(w) * nvfp4._reciprocal(gs))).clamp(-F4E2M1_MAX, F4E2M1_MAX)
        return fast_elements.e2m1_codes(scaled, signed_zero=True).to(torch.uint8)

    return {"block amax": amax, "+ scale rule": scale, "+ element rounding": rounded,
            "whole kernel (+ packing, layout)": lambda w: nvfp4._quantize_kernel(w, gs, block, _ENGINE, True)}


def stages(fmt: PrecisionFormat) -> dict[str, Stage]:
    """The format's stages, cumulative, in order."""
    if fmt is FP8_BLOCK:
        return _fp8_stages()
    if fmt is NVFP4:
        return _nvfp4_stages()
    return _mx_stages(fmt)


def profile(fmt: PrecisionFormat, chunk: torch.Tensor, repeat: int) -> dict[str, float]:
    """Each stage's throughput compiled on `chunk`, GB/s of its bytes, measured in turns.

    Args:
        fmt: the format.
        chunk: a [rows, K] weight chunk.
        repeat: measured rounds.

    Returns:
        Stage name -> GB/s, in stage order.
    """
    compiled = {name: torch.compile(fn, fullgraph=True, dynamic=False) for name, fn in stages(fmt).items()}
    fns = {name: (lambda fn=fn: fn(chunk)) for name, fn in compiled.items()}
    seconds = measure_interleaved(fns, repeat=repeat)
    gbytes = chunk.numel() * chunk.element_size() / 1e9
    return {name: gbytes / s for name, s in seconds.items()}
