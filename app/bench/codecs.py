"""`refit bench codecs`: quantize throughput per preset and element rule against compressed-tensors,
torchao and the memory-bandwidth bound (a plain `copy_` of the same bytes), all on the same tensor
in one run. The default rule (`engine`) is also measured against the `compressed-tensors` rule,
the operation order the codecs had before the rules were named, eager, compiled and native (the
native kernels where they build: adapters/native_codecs/)."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

import torch

from app.bench.engine_device import synchronizer
from app.bench.report import BenchReport, measure, measure_interleaved
from domain.quant.codecs import compile as kernels
from domain.quant.codecs import quantize_weight
from domain.quant.formats import FP8_BLOCK, MXFP4, MXFP8, NVFP4, ElementRule, PrecisionFormat


def _ct_path(fmt: PrecisionFormat, w: torch.Tensor) -> Callable[[], object] | None:
    """compressed-tensors' own path: observer-style min/max, calculate_qparams, the compressor."""
    try:
        from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
        from compressed_tensors.compressors.mxfp8.base import MXFP8QuantizationCompressor
        from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
        from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
        from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
        from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    except ImportError:
        return None
    n, k = w.shape
    scheme = preset_name_to_scheme(fmt.name, ["Linear"])

    def group(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = w.float().reshape(n, k // size, size)
        return g.amin(-1), g.amax(-1)

    def run() -> object:
        if fmt is NVFP4:
            wf = w.float()
            gs = generate_gparam(wf.amin().reshape(1), wf.amax().reshape(1))
            scale, _ = calculate_qparams(*group(16), scheme.weights, global_scale=gs)
            return NVFP4PackedCompressor.compress(
                {"weight": w, "weight_scale": scale, "weight_global_scale": gs}, scheme
            )
        if fmt is FP8_BLOCK:
            b = w.float().reshape(n // 128, 128, k // 128, 128)
            scale, _ = calculate_qparams(b.amin(dim=(1, 3)), b.amax(dim=(1, 3)), scheme.weights)
            return FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
        compressor = MXFP8QuantizationCompressor if fmt is MXFP8 else MXFP4PackedCompressor
        scale, _ = calculate_qparams(*group(32), scheme.weights)
        return compressor.compress({"weight": w, "weight_scale": scale}, scheme)

    return run


def _torchao_path(fmt: PrecisionFormat, w: torch.Tensor) -> Callable[[], object] | None:
    """torchao's MX (RCEIL) and NVFP4 references; torchao has no CPU FP8 128x128 block quantizer."""
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
    except ImportError:
        return None
    if fmt is NVFP4:
        return lambda: nvfp4_quantize(w, 16, per_tensor_amax_to_scale(w.float().abs().amax()))
    if fmt in (MXFP8, MXFP4):
        elem = torch.float8_e4m3fn if fmt is MXFP8 else torch.float4_e2m1fn_x2
        return lambda: to_mx(w, elem, 32, ScaleCalculationMode.RCEIL)
    return None


# The share of the copy_ bound each preset's fast path is held to (the FP4 formats compute more
# per element and write half as many bytes: their own, lower target).
TARGETS = {FP8_BLOCK.name: 0.25, MXFP8.name: 0.25, MXFP4.name: 0.10, NVFP4.name: 0.10}


def run(quick: bool = False, device: str = "cpu") -> BenchReport:
    size = 1024 if quick else 4096
    repeat = 2 if quick else 5
    report = BenchReport("codecs")
    load_before = _load_average()
    w = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    gbytes = w.numel() * w.element_size() / 1e9
    case = f"{size}x{size} bf16" if w.device.type == "cpu" else f"{size}x{size} bf16 on {w.device}"
    dst = torch.empty_like(w)
    done = synchronizer(w.device)  # a GPU's queued work is part of each timing

    def timed(fn: Callable[[], object]) -> Callable[[], object]:
        return lambda: (fn(), done())

    copy = timed(lambda: dst.copy_(w))
    copy_s = measure(copy, repeat=repeat)
    cast_s = measure(timed(lambda: w.to(torch.float8_e4m3fn)), repeat=repeat)
    report.add(case, "copy_ (memory bound)", gbytes / copy_s, "GB/s")
    report.add(case, "bare cast to float8_e4m3fn", gbytes / cast_s, "GB/s", "copy_", gbytes / copy_s)
    shares = []
    native_missing = _native() if w.device.type == "cpu" else "the native kernels run on the CPU only"
    if native_missing is not None:
        report.notes.append(f"native codecs not measured: {native_missing}")
    for fmt in (FP8_BLOCK, MXFP8, MXFP4, NVFP4):
        fns = {rule.value: timed(functools.partial(quantize_weight, fmt, w, numerics=rule)) for rule in ElementRule}
        kernels.set_compiled(False)
        eager = measure_interleaved(fns, repeat=repeat)
        kernels.set_compiled(True)
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            report.notes.append(f"{fmt.name} {name}: first compiled call {time.perf_counter() - t0:.1f} s "
                                "(compile, then cached)")
        fast = measure_interleaved({**fns, "copy_": copy}, repeat=repeat)  # the bound in turns with the fast path
        kernels.set_compiled(False)
        eager_s = {rule: eager[rule.value] for rule in ElementRule}
        fast_s = {rule: fast[rule.value] for rule in ElementRule}
        engine, ct_rule = ElementRule.ENGINE, ElementRule.COMPRESSED_TENSORS
        ours = gbytes / fast_s[engine]
        refs = {"compressed-tensors": _ct_path(fmt, w), "torchao": _torchao_path(fmt, w)}
        ref_speeds = {name: gbytes / measure(timed(fn), repeat=repeat) for name, fn in refs.items() if fn is not None}
        case_name = f"{fmt.name} {case}"
        for name, speed in ref_speeds.items():
            report.add(case_name, "quantize (compiled)", ours, "GB/s", name, speed)
        report.add(case_name, "quantize (eager)", gbytes / eager_s[engine], "GB/s",
                   "compressed-tensors", ref_speeds.get("compressed-tensors"))
        row = report.add(case_name, "quantize (compiled)", ours, "GB/s", "copy_ bound (in turns)",
                         gbytes / fast["copy_"])
        if native_missing is None:  # the native kernels, in turns with their own copy_ bound
            with kernels.use(kernels.CodecPath.NATIVE):
                native = measure_interleaved({**fns, "copy_": copy}, repeat=repeat)
            native_gbps = gbytes / native[engine.value]
            row = report.add(case_name, "quantize (native)", native_gbps, "GB/s", "copy_ bound (in turns)",
                             gbytes / native["copy_"])
            report.add(case_name, "quantize (native)", native_gbps, "GB/s", "quantize (compiled)", ours)
            report.add(case_name, "quantize (native, engine rule)", native_gbps, "GB/s",
                       "compressed-tensors rule (native)", gbytes / native[ct_rule.value])
        shares.append(_share_note(fmt, row.ratio or 0.0, "native" if native_missing is None else "compiled"))
        report.add(case_name, "quantize (compiled)", ours, "GB/s", "quantize (eager)", gbytes / eager_s[engine])
        for mode, times in (("eager", eager_s), ("compiled", fast_s)):
            report.add(case_name, f"quantize ({mode}, engine rule)", gbytes / times[engine], "GB/s",
                       f"compressed-tensors rule ({mode})", gbytes / times[ct_rule])
        report.notes.append(_stages_note(fmt, w, repeat))
    report.notes += shares
    report.notes.append(_bound_note(gbytes / copy_s, gbytes / cast_s))
    report.notes.append(f"load average (1 min) before and after: {load_before} and {_load_average()} on "
                        f"{os.cpu_count()} cores (other work on the machine skews every timing; the shares are "
                        "measured in turns, so a load change hits the codec and its bound alike)")
    report.notes.append("ratio = ours / baseline throughput; against copy_ it is the share of the memory bound")
    report.notes.append("rows without a rule measure the default rule (engine); 'compressed-tensors rule' is the "
                        "operation order of the codecs before the element rules were named, run in turns with it")
    return report


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _native() -> str | None:
    """Build and install the native kernels (app.composition.tables.native_codecs): None, or why not."""
    from app.composition.tables import native_codecs

    return native_codecs()


def _share_note(fmt: PrecisionFormat, share: float, path: str = "compiled") -> str:
    target = TARGETS[fmt.name]
    verdict = "met" if share >= target else "NOT met"
    return (f"{fmt.name}: the fast path ({path}) reaches {share:.0%} of the copy_ bound measured in turns with it "
            f"(target {target:.0%}: {verdict})")


def _stages_note(fmt: PrecisionFormat, w: torch.Tensor, repeat: int) -> str:
    from app.bench.codec_stages import profile
    from domain.quant.codecs.api import chunk_rows

    rows = chunk_rows(w.shape[-1], fmt.block_size[0], kernels.CodecPath.COMPILED)
    chunk = w[:rows]
    speeds = profile(fmt, chunk, repeat)
    parts = "; ".join(f"{name} {gbps:.2f} GB/s" for name, gbps in speeds.items())
    return (f"{fmt.name} compiled, stage by stage on one {rows}x{w.shape[-1]} chunk (each stage includes the ones "
            f"before it): {parts}")


def _bound_note(copy_gbps: float, cast_gbps: float) -> str:
    return (f"the copy_ bound ({copy_gbps:.1f} GB/s here) is the memory system's limit on {torch.get_num_threads()} "
            "thread(s): it reads and writes 2 bytes per element and computes nothing, where a codec reads the same "
            "2 bytes, writes 1 (E4M3) or 0.5 (FP4) plus its scales, and computes a block maximum, a scale and a "
            f"rounding per element; the bare float8 cast alone (no scale, {cast_gbps:.2f} GB/s) shows what one "
            "per-element conversion costs against it. The native kernels are bound by that per-element "
            "arithmetic (a rounding on the float's bits, 8 lanes wide) and by one scalar scale per block (a "
            "division, and for NVFP4 two reciprocals and an E4M3 round trip per 16 elements), not by memory; "
            "the compiled path by its float8 cast and its E2M1 rounding in float operations: see its stages")
