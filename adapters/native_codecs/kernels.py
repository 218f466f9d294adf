"""The native kernels as the codecs call them: each takes a codec kernel's arguments
(domain/quant/codecs/fp8_block.py, mx.py, nvfp4.py) and returns its outputs, or None for a call it does not
port (another dtype, block or rule), which then takes the compiled path."""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from domain.quant.codecs import fp8_block, mx, nvfp4
from domain.quant.codecs.compile import install_native
from domain.quant.formats import ElementRule, ElementType, MxScaleRule

SOURCE = Path(__file__).with_name("codecs.cpp")
# One build per torch release: the extension cache is keyed by name and sources, and a build links
# against the torch that made it (an engine's environment may hold another torch).
NAME = "rl_refit_native_codecs_torch" + "".join(c if c.isalnum() else "_" for c in torch.__version__)


def _has_avx2() -> bool:
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return x86 and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.cache
def module(avx2: bool | None = None) -> ModuleType:
    """The built extension (built on first use, then loaded from torch's extension cache).

    Args:
        avx2: None: with AVX2 where this CPU has it; False: the scalar code only (a build of its
            own, which the tests hold to the same bytes).
    """
    from torch.utils.cpp_extension import load

    vector = _has_avx2() if avx2 is None else avx2
    # -ffp-contract=off: no fused multiply-add, each product and sum rounds as torch's do;
    # -fopenmp: at::parallel_for spreads the blocks over torch's threads only in an OpenMP build
    flags = ["-O3", "-ffp-contract=off", "-fopenmp", *(["-mavx2", "-mfma"] if vector else [])]
    return load(NAME + ("" if vector else "_scalar"), sources=[str(SOURCE)], extra_cflags=flags,
                extra_ldflags=["-fopenmp"], verbose=False)


def _fp8_block(w: torch.Tensor, block: tuple[int, int], rule: ElementRule,
               activation: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    if w.dtype != torch.bfloat16 or tuple(block) != (128, 128) or activation or w.dim() < 2 or w.device.type != "cpu":
        return None
    lead = w.shape[:-2]
    q, scale, amax = module().fp8_block(w.reshape(-1, *w.shape[-2:]).contiguous(), rule is ElementRule.ENGINE)
    return (q.view(torch.float8_e4m3fn).reshape(w.shape), scale.reshape(*lead, *scale.shape[-2:]),
            amax.reshape(*lead, *amax.shape[-2:]))


def _mx(w: torch.Tensor, element: ElementType, block: int, scale_rule: MxScaleRule,
        rule: ElementRule) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    if w.dtype != torch.bfloat16 or block != 32 or w.shape[-1] % 32 or w.device.type != "cpu" or w.dim() < 1:
        return None
    e4m3 = element is ElementType.E4M3
    q, e, amax = module().mx(w.reshape(-1, w.shape[-1]).contiguous(), e4m3, scale_rule is MxScaleRule.RCEIL,
                             rule is ElementRule.ENGINE, float(element.max), int(element.emax))
    lead = w.shape[:-1]
    elements = q.view(torch.float8_e4m3fn).reshape(w.shape) if e4m3 else q.reshape(*lead, -1)
    return elements, e.reshape(*lead, -1), amax.reshape(*lead, -1, 1)


def _nvfp4(w: torch.Tensor, gscale: torch.Tensor, block: int,
           rule: ElementRule) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    if w.dtype != torch.bfloat16 or block != 16 or w.shape[-1] % 16 or w.device.type != "cpu" or w.dim() < 2:
        return None
    gs = gscale.float().reshape(-1)
    if gs.numel() == 1:
        matrices = w.reshape(1, -1, w.shape[-1])
    elif w.dim() == 3 and tuple(gscale.shape) == (w.shape[0], 1):  # one global scale per expert
        matrices = w
    else:
        return None
    q, scale, amax = module().nvfp4(matrices.contiguous(), gs.contiguous(), rule is ElementRule.ENGINE)
    lead = w.shape[:-1]
    return (q.reshape(*lead, -1), scale.view(torch.float8_e4m3fn).reshape(*lead, -1),
            amax.reshape(*lead, -1, 1))


def _amax(t: torch.Tensor) -> torch.Tensor | None:
    if t.dtype != torch.bfloat16 or t.dim() < 2 or t.device.type != "cpu" or t.numel() == 0:
        return None
    lead = t.shape[:-2]
    return module().amax(t.reshape(-1, t.shape[-2] * t.shape[-1]).contiguous()).reshape(lead)


def install() -> str | None:
    """Build the kernels and install them as the `native` codec path; None when installed, else
    why not (the build's first line of error)."""
    try:
        module()
    except Exception as err:  # a missing compiler, a failed build: the other paths remain
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        return f"the native codecs did not build ({type(err).__name__}: {first})"
    install_native(fp8_block._quantize_kernel, _fp8_block)
    install_native(mx._quantize_kernel, _mx)
    install_native(nvfp4._quantize_kernel, _nvfp4)
    install_native(nvfp4._amax_kernel, _amax)
    return None


def vectorized() -> bool:
    """Whether the built kernels use AVX2 (else their scalar code)."""
    return bool(module().vectorized())


def encoders() -> Any:
    """The element encoders alone (`e4m3_bytes(x)`, `e2m1_codes(x, signed_zero)`), for tests."""
    return module()
