"""Weights a checkpoint already stores quantized: which modules, in which preset, and how they
decode back to a dense weight.

A re-export of an exported checkpoint meets `weight_packed`, float8 `weight` and `weight_scale`
tensors where a BF16 checkpoint has one `weight`. They are recognised by their exact tensor set
(names, dtypes and shapes are what `domain.quant.stream.format_specs` gives for one preset), so a
quantized module is decoded with that preset's codec (`dequantize_weight`) or, when its tensors
match no preset, reported with what was found: never passed on as if it were BF16.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs
import torch

from domain.quant.formats import FP8_BLOCK, MXFP4, MXFP8, NVFP4, PrecisionFormat
from domain.quant.stream import format_specs

# Local tensor names that only quantized checkpoints carry (compressed-tensors, native FP8,
# GPTQ/AWQ-style packings): a module holding one of them is not a BF16 module.
QUANTIZED_LOCALS = (
    "weight_packed", "weight_scale", "weight_scale_inv", "weight_global_scale", "weight_zero_point",
    "weight_g_idx", "weight_shape", "input_global_scale", "input_scale", "input_zero_point",
    "qweight", "qzeros", "scales", "g_idx",
)
# Activation scales travel with a quantized weight but are not part of it: decoding drops them.
_ACTIVATION_LOCALS = ("input_global_scale", "input_scale")
_DECODABLE = (FP8_BLOCK, MXFP8, MXFP4, NVFP4)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)


@attrs.frozen
class StoredModule:
    """One module whose weight the checkpoint stores quantized.

    Attributes:
        module: the module name (`model.layers.0.mlp.down_proj`).
        tensors: the full names of its stored weight tensors (scales included).
        format: the preset its tensors are exactly the layout of, or None when they match none.
        shape: the logical weight shape [N, K] (empty when unknown).
        scale_name: `weight_scale` or `weight_scale_inv`.
        found: the stored tensors as `local dtype [shape]`, for messages.
    """

    module: str
    tensors: tuple[str, ...]
    format: PrecisionFormat | None
    shape: tuple[int, ...] = ()
    scale_name: str = "weight_scale"
    found: str = ""

    @property
    def weight(self) -> str:
        """The name of the dense weight it decodes to."""
        return f"{self.module}.weight"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _same(have: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
          expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> bool:
    if have.keys() != expected.keys():
        return False
    for local, (shape, dtype) in have.items():
        want_shape, want_dtype = expected[local]
        e8m0_as_u8 = dtype == _E8M0 and want_dtype == torch.uint8
        if shape != want_shape or (dtype != want_dtype and not e8m0_as_u8):
            return False
    return True


def _match(module: str, locals_: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> StoredModule:
    names = tuple(f"{module}.{loc}" for loc in sorted(locals_))
    found = ", ".join(f"{loc} {_dtype_name(d)} {list(s)}" for loc, (s, d) in sorted(locals_.items()))
    weight = locals_.get("weight_packed") or locals_.get("weight")
    scale_name = "weight_scale_inv" if "weight_scale_inv" in locals_ else "weight_scale"
    have = {k: v for k, v in locals_.items() if k not in _ACTIVATION_LOCALS}
    if weight is not None and len(weight[0]) == 2:
        n, cols = weight[0]
        k = cols * 2 if "weight_packed" in locals_ else cols
        for fmt in _DECODABLE:
            specs = format_specs(fmt, module, (n, k), scale_name)
            expected = {s.name.rsplit(".", 1)[1]: (s.shape, s.dtype) for s in specs}
            if _same(have, expected):
                return StoredModule(module, names, fmt, (n, k), scale_name, found)
    return StoredModule(module, names, None, (), scale_name, found)


def find_stored(specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> dict[str, StoredModule]:
    """Every module whose weight is stored quantized.

    Args:
        specs: the checkpoint's (name, shape, dtype) triples.

    Returns:
        module name -> StoredModule, for modules that hold a quantized-only tensor
        (QUANTIZED_LOCALS) or a float8 `weight`.
    """
    by_module: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}
    marked: set[str] = set()
    for name, shape, dtype in specs:
        module, _, local = name.rpartition(".")
        if local in QUANTIZED_LOCALS or (local == "weight" and dtype.is_floating_point and dtype.itemsize == 1):
            marked.add(module)
        if local in QUANTIZED_LOCALS or local == "weight":
            by_module.setdefault(module, {})[local] = (tuple(shape), dtype)
    return {m: _match(m, by_module[m]) for m in sorted(marked)}


def decode(stored: StoredModule, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The dense weight a stored module's tensors encode.

    Args:
        stored: a decodable StoredModule (its format is set).
        tensors: its stored tensors by full name.
        dtype: the dtype of the result.

    Returns:
        `dequantize_weight` of the tensors: [N, K] in `dtype`.
    """
    from domain.quant.codecs import QuantizedWeight, dequantize_weight

    fmt = stored.format
    if fmt is None:
        raise ValueError(f"{stored.module}: no preset decodes {stored.found}")
    local = {name.rsplit(".", 1)[1]: t for name, t in tensors.items()}
    parts = {fmt.weight_name: local[fmt.weight_name], "weight_scale": local[stored.scale_name]}
    if parts["weight_scale"].dtype == _E8M0:
        parts["weight_scale"] = parts["weight_scale"].view(torch.uint8)
    if fmt.has_global_scale:
        parts["weight_global_scale"] = local["weight_global_scale"]
    return dequantize_weight(QuantizedWeight(fmt, parts, stored.shape, dtype), dtype)
