"""Weight codecs: one per format family, behind one small interface, in an explicit registry."""

from __future__ import annotations

from typing import Protocol

import attrs
import torch

from domain.errors import InvalidTensor
from domain.quant.codecs import compile as kernels
from domain.quant.codecs import fp8_block, mx, nvfp4
from domain.quant.codecs.checks import check_weight
from domain.quant.formats import FP8_BLOCK, MXFP4, MXFP8, NVFP4, ElementRule, MxScaleRule, PrecisionFormat

Tensors = dict[str, torch.Tensor]


class WeightCodec(Protocol):
    def encode(
        self, w: torch.Tensor, name: str, global_scale: torch.Tensor | None, numerics: ElementRule,
        scale_rule: MxScaleRule | None,
    ) -> Tensors: ...

    def decode(self, tensors: Tensors) -> torch.Tensor: ...


@attrs.frozen
class Fp8BlockCodec:
    fmt: PrecisionFormat

    def encode(self, w: torch.Tensor, name: str, global_scale: torch.Tensor | None, numerics: ElementRule,
               scale_rule: MxScaleRule | None) -> Tensors:
        q, scale = fp8_block.quantize(w, name, self.fmt.block_size, numerics)
        return {"weight": q, "weight_scale": scale}

    def decode(self, tensors: Tensors) -> torch.Tensor:
        return fp8_block.dequantize(tensors["weight"], tensors["weight_scale"], self.fmt.block_size)


@attrs.frozen
class MxCodec:
    fmt: PrecisionFormat

    def encode(self, w: torch.Tensor, name: str, global_scale: torch.Tensor | None, numerics: ElementRule,
               scale_rule: MxScaleRule | None) -> Tensors:
        elements, scale = mx.quantize(w, name, self.fmt, numerics, scale_rule)
        return {self.fmt.weight_name: elements, "weight_scale": scale}

    def decode(self, tensors: Tensors) -> torch.Tensor:
        return mx.dequantize(tensors[self.fmt.weight_name], tensors["weight_scale"], self.fmt)


@attrs.frozen
class Nvfp4Codec:
    def encode(self, w: torch.Tensor, name: str, global_scale: torch.Tensor | None, numerics: ElementRule,
               scale_rule: MxScaleRule | None) -> Tensors:
        gs = nvfp4.global_scale(w, name=name, rule=numerics) if global_scale is None else global_scale.float()
        expected = (*w.shape[:-2], 1)
        if tuple(gs.shape) != expected:
            raise InvalidTensor(
                name, f"global scale of shape {tuple(gs.shape)} given for a weight of shape "
                f"{tuple(w.shape)}", f"pass one of shape {expected} (nvfp4_global_scale computes it)"
            )
        packed, scale = nvfp4.quantize(w, name, gs, numerics)
        return {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": gs}

    def decode(self, tensors: Tensors) -> torch.Tensor:
        return nvfp4.dequantize(tensors["weight_packed"], tensors["weight_scale"], tensors["weight_global_scale"])


CODECS: dict[str, WeightCodec] = {
    FP8_BLOCK.name: Fp8BlockCodec(FP8_BLOCK),
    MXFP8.name: MxCodec(MXFP8),
    MXFP4.name: MxCodec(MXFP4),
    NVFP4.name: Nvfp4Codec(),
}


@attrs.frozen(eq=False)
class QuantizedWeight:
    """A weight in its checkpoint encoding.

    Attributes:
        format: the preset.
        tensors: local checkpoint names ("weight" or "weight_packed", "weight_scale",
            "weight_global_scale") to tensors.
        shape: the logical (unpacked) shape of the weight.
        dtype: the dtype of the weight that was quantized.
    """

    format: PrecisionFormat
    tensors: Tensors
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _codec(fmt: PrecisionFormat) -> WeightCodec:
    try:
        return CODECS[fmt.name]
    except KeyError:
        raise ValueError(f"{fmt.name} is not a quantized format; valid: {', '.join(CODECS)}") from None


@torch.no_grad()
def quantize_weight(
    fmt: PrecisionFormat,
    w: torch.Tensor,
    *,
    name: str = "weight",
    global_scale: torch.Tensor | None = None,
    numerics: ElementRule = ElementRule.ENGINE,
    scale_rule: MxScaleRule | None = None,
) -> QuantizedWeight:
    """Quantize a Linear weight [N, K] or expert weights [E, N, K] (per expert) into `fmt`.

    Args:
        fmt: a quantized preset (FP8_BLOCK, MXFP8, MXFP4, NVFP4).
        w: the weight, bfloat16, float16 or float32.
        name: the tensor's name, used in errors.
        global_scale: NVFP4 only: a shared global scale (see `nvfp4_global_scale`); computed from
            `w` alone when omitted.
        numerics: the element rule: ENGINE (the engine's own quantizer, default) or
            COMPRESSED_TENSORS (llm-compressor checkpoints byte for byte).
        scale_rule: MX only: the exponent rule; None = the format's rule under `numerics`
            (`fmt.scale_rule`: MXFP8 rceil and MXFP4 even under engine, even under compressed-tensors).

    Returns:
        The checkpoint tensors, all computed before anything is returned.

    Raises:
        InvalidTensor: (subclasses) wrong dtype, rank, K not a multiple of the block, NaN/Inf.
    """
    codec = _codec(fmt)
    check_weight(w, name, k_multiple=fmt.k_multiple, fmt_name=fmt.name)
    w = w.detach()
    if global_scale is None and fmt.has_global_scale:
        global_scale = nvfp4.global_scale(w, name=name, rule=numerics)  # over the whole tensor, before chunking
    if w.dim() == 3:
        per_expert = [
            _encode_rows(codec, fmt, w[e], name, None if global_scale is None else global_scale[e], numerics,
                         scale_rule)
            for e in range(w.shape[0])
        ]
        tensors = {key: torch.stack([t[key] for t in per_expert]) for key in per_expert[0]}
    else:
        tensors = _encode_rows(codec, fmt, w, name, global_scale, numerics, scale_rule)
    return QuantizedWeight(fmt, tensors, tuple(w.shape), w.dtype)


# Rows go through the codec in chunks of about this many elements: the kernels' float32
# temporaries then stay in the CPU caches (about 3x faster eagerly on a 4096 x 4096 tensor) and
# peak scratch memory is bounded whatever the tensor's size. Every block lies within one chunk
# (chunks are whole multiples of the block's rows), so chunking never changes a bit.
CHUNK_ELEMENTS = 2**18
# The compiled path's chunks: larger (a compiled call costs tens of microseconds, and its kernel
# keeps no float32 temporaries), and a power of two of rows for a given row length, so that every
# weight with that row length (and whole chunks) reuses one compiled kernel.
COMPILED_CHUNK_ELEMENTS = 2**20
# The native path's chunks: its kernels keep no temporaries and split the work over the threads
# themselves, so a weight is one call (up to this many elements), with no outputs to concatenate.
NATIVE_CHUNK_ELEMENTS = 2**28


def chunk_rows(k: int, block_rows: int, path: kernels.CodecPath) -> int:
    """Rows per chunk for a weight whose rows hold `k` elements.

    Args:
        k: the row length.
        block_rows: the format's block rows (chunks hold whole blocks).
        path: the codec path.

    Returns:
        Eager: about CHUNK_ELEMENTS per chunk; native: about NATIVE_CHUNK_ELEMENTS; compiled: the
        largest power of two of rows within COMPILED_CHUNK_ELEMENTS (at least one block).
    """
    if path is kernels.CodecPath.EAGER:
        return max(block_rows, CHUNK_ELEMENTS // max(k, 1) // block_rows * block_rows)
    if path is kernels.CodecPath.NATIVE:
        return max(block_rows, NATIVE_CHUNK_ELEMENTS // max(k, 1) // block_rows * block_rows)
    rows = 1 << max(0, (COMPILED_CHUNK_ELEMENTS // max(k, 1)).bit_length() - 1)
    return max(block_rows, rows // block_rows * block_rows)


def _encode_rows(
    codec: WeightCodec,
    fmt: PrecisionFormat,
    w: torch.Tensor,
    name: str,
    global_scale: torch.Tensor | None,
    numerics: ElementRule,
    scale_rule: MxScaleRule | None,
) -> Tensors:
    rows = chunk_rows(w.shape[-1], fmt.block_size[0], kernels.current())
    if w.shape[0] <= rows:
        return codec.encode(w, name, global_scale, numerics, scale_rule)
    parts = [codec.encode(w[i:i + rows], name, global_scale, numerics, scale_rule) for i in range(0, w.shape[0], rows)]
    return {
        key: parts[0][key] if key == "weight_global_scale" else torch.cat([p[key] for p in parts])
        for key in parts[0]
    }


@torch.no_grad()
def dequantize_weight(q: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode checkpoint tensors back to a dense weight of `q.shape` in `dtype`."""
    return _codec(q.format).decode(q.tensors).to(dtype)


def fake_quantize_weight(
    fmt: PrecisionFormat,
    w: torch.Tensor,
    *,
    global_scale: torch.Tensor | None = None,
    numerics: ElementRule = ElementRule.ENGINE,
    scale_rule: MxScaleRule | None = None,
    name: str = "weight",
) -> torch.Tensor:
    """dequantize(quantize(w)) in w's dtype: the values the rollout computes with."""
    q = quantize_weight(fmt, w, name=name, global_scale=global_scale, numerics=numerics, scale_rule=scale_rule)
    return dequantize_weight(q, w.dtype)


def nvfp4_global_scale(
    *tensors: torch.Tensor, name: str = "weight", numerics: ElementRule = ElementRule.ENGINE
) -> torch.Tensor:
    """The NVFP4 global scale shared by a fused group (q/k/v, gate/up): (6 * 448) / amax over all.

    Args:
        tensors: the group's weights, all [N_i, K] or all [E, N_i, K].
        name: the group's name, for errors.
        numerics: the element rule; it decides a zero maximum (amax clamped to 1e-8 under
            engine, 1.0 under compressed-tensors).

    Returns:
        float32 [1] (2-D) or [E, 1] (3-D experts).
    """
    return nvfp4.global_scale(*tensors, name=name, rule=numerics)
