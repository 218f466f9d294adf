"""A native layout passed through untouched must be what its quantization_config says it is.

`refit export` copies a checkpoint whose `quantization_config` the trainer cannot produce (GPTQ,
AWQ, GPT-OSS's mxfp4, per-tensor FP8, compressed-tensors schemes that are no preset) as it is,
config and tensors alike. An engine loads such a checkpoint by its config: a config that claims
GPTQ 4-bit over BF16 tensors, FP8 weights without scales or 4-bit packing where 8 bits are stored
makes it fail at load, or serve garbage. `check_native_tensors` compares the two, from the
headers alone:

- every Linear weight the config quantizes must not be stored as a plain floating-point `weight`;
- every stored quantized weight must have its scale tensors, and be packed in the dtype and
  shape of the config's bit width (GPTQ / AWQ `qweight` int32 against its `scales`, mxfp4's
  uint8 blocks of 16 bytes against one E8M0 scale each, compressed-tensors' 4-bit `weight_packed`
  against an 8-bit `weight`).

Pure inspection of names, shapes and dtypes.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from domain.errors import NativeLayoutMismatch
from domain.quant import naming
from domain.quant.ct_config import config_group

Spec = tuple[str, tuple[int, ...], torch.dtype]
_FLOATING = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_SKIP_FIELDS = ("modules_to_not_convert", "ignored_layers", "ignore")
_PACKED_BITS = (2, 4, 8)  # bit widths whose values fill an int32 exactly
MXFP4_BLOCK_BYTES = 16  # 32 E2M1 values, two to a byte
# The methods whose stored layout is checked; any other passes through as it is.
CHECKED_METHODS = ("gptq", "awq", "mxfp4", "fp8", "compressed-tensors")


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _skip_matches(entry: str, module: str) -> bool:
    """A skip-list entry as its loaders read it: a `re:` pattern, a shell pattern
    (`model.layers.*.self_attn`), else a substring of the module name, as transformers reads
    `modules_to_not_convert` (exact names and dotted prefixes included)."""
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    if any(c in entry for c in "*?["):
        return fnmatch.fnmatchcase(module, entry) or fnmatch.fnmatchcase(module, entry + ".*")
    return entry in module


def _skipped(qc: Mapping[str, Any], module: str) -> bool:
    entries = [e for f in _SKIP_FIELDS for e in naming.name_list(qc.get(f)) or ()]
    return any(_skip_matches(e, module) for e in entries)


def _claims(qc: Mapping[str, Any], method: str, module: str, kind: str) -> bool:
    """Whether the config says `module` (a dense or expert Linear) is stored quantized."""
    if method == "compressed-tensors":
        return config_group(qc, module) is not None
    if method == "mxfp4":  # GPT-OSS's: the routed experts only
        return kind == "expert" and not _skipped(qc, module)
    return not _skipped(qc, module)


def _bits(qc: Mapping[str, Any]) -> int | None:
    value = qc.get("bits", qc.get("w_bit"))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _describe(qc: Mapping[str, Any], method: str) -> str:
    bits = _bits(qc)
    return f"quant_method {method!r}" + (f", {bits} bits" if bits is not None else "")


def _floating_claimed(qc: Mapping[str, Any], method: str, specs: Sequence[Spec]) -> Iterator[tuple[str, str]]:
    for name, shape, dtype in specs:
        if dtype not in _FLOATING:
            continue
        cls = naming.classify(name, tuple(shape))
        if cls.kind != "passthrough" and _claims(qc, method, cls.module, cls.kind):
            yield name, (f"is stored as {_dtype(dtype)} {list(shape)}, but the checkpoint's quantization_config "
                         f"({_describe(qc, method)}) says module {cls.module!r} is quantized")


def _packing_matches(qc: Mapping[str, Any], method: str, module: str, qweight: tuple[int, ...],
                     by_name: Mapping[str, Spec], bits: int) -> bool:
    """Whether `qweight` and its scales (and GPTQ's `g_idx`) have the shapes of `bits`-bit packing.

    GPTQ packs along K (qweight [K / pack, N]), AWQ along N (qweight [K, N / pack]); scales are
    [ceil(K / group_size), N] (one row without groups) and `g_idx` [K].
    """
    pack = 32 // bits
    if len(qweight) != 2:
        return False
    k, n = (qweight[0] * pack, qweight[1]) if method == "gptq" else (qweight[0], qweight[1] * pack)
    scales = by_name[f"{module}.scales"][1]
    group = qc.get("group_size")
    rows = -(-k // group) if isinstance(group, int) and not isinstance(group, bool) and group > 0 else None
    g_idx = by_name.get(f"{module}.g_idx")
    return scales[-1] == n and (rows is None or scales[0] == rows) and (g_idx is None or g_idx[1] == (k,))


def _gptq_awq(qc: Mapping[str, Any], method: str, by_name: Mapping[str, Spec]) -> Iterator[tuple[str, str]]:
    bits = _bits(qc)
    for name, shape, dtype in by_name.values():
        if not name.endswith(".qweight"):
            continue
        module = name.removesuffix(".qweight")
        if dtype != torch.int32:
            yield name, f"is {_dtype(dtype)}; {method} packs weights into int32"
        elif f"{module}.scales" not in by_name:
            yield name, f"has no {module}.scales; {method} weights cannot be read without their scales"
        elif bits not in _PACKED_BITS:
            yield name, f"is packed for a config whose bits is {bits!r}; {method} packs 2, 4 or 8 bits into int32"
        elif not _packing_matches(qc, method, module, shape, by_name, bits):
            scales = list(by_name[f"{module}.scales"][1])
            yield name, f"is {list(shape)} with scales {scales}: not the {bits}-bit {method} packing the config says"


def _mxfp4(by_name: Mapping[str, Spec]) -> Iterator[tuple[str, str]]:
    for name, shape, dtype in by_name.values():
        if not name.endswith("_blocks"):
            continue
        scales = by_name.get(name.removesuffix("_blocks") + "_scales")
        if dtype != torch.uint8 or shape[-1:] != (MXFP4_BLOCK_BYTES,):
            yield name, f"is {_dtype(dtype)} {list(shape)}; mxfp4 blocks are uint8 [..., {MXFP4_BLOCK_BYTES}]"
        elif scales is None or scales[2] != torch.uint8 or scales[1] != shape[:-1]:
            found = "none" if scales is None else f"{_dtype(scales[2])} {list(scales[1])}"
            yield name, f"needs uint8 scales {list(shape[:-1])} (E8M0, one per block), found {found}"


def _scaled(by_name: Mapping[str, Spec], method: str) -> Iterator[tuple[str, str]]:
    """compressed-tensors and fp8: a quantized weight (packed, or of one byte per value) has a scale."""
    for name, _, dtype in by_name.values():
        module, _, local = name.rpartition(".")
        quantized = local == "weight_packed" or (local == "weight" and dtype.itemsize == 1)
        if quantized and f"{module}.weight_scale" not in by_name and f"{module}.weight_scale_inv" not in by_name:
            yield name, f"is a quantized weight ({_dtype(dtype)}) without {module}.weight_scale; {method} needs it"


def _ct_bits(qc: Mapping[str, Any], by_name: Mapping[str, Spec]) -> Iterator[tuple[str, str]]:
    """compressed-tensors: a weight stored one byte per value must be what its group's num_bits says."""
    for name, shape, dtype in by_name.values():
        module, _, local = name.rpartition(".")
        group = config_group(qc, module) if local in ("weight", "weight_packed") and dtype not in _FLOATING else None
        weights = group.get("weights") if group is not None else None
        bits = weights.get("num_bits") if isinstance(weights, Mapping) else None
        if bits == 8 and local == "weight_packed":
            yield name, "is packed, but its config group quantizes to 8 bits (one value per byte, `weight`)"
        elif bits == 4 and local == "weight":
            yield name, f"is {_dtype(dtype)} {list(shape)}, one value per byte, but its config group quantizes to 4 bits"


def check_native_tensors(qc: Mapping[str, Any], method: str, specs: Sequence[Spec]) -> None:
    """Refuse a native pass-through whose tensors are not the layout its quantization_config says.

    Args:
        qc: the checkpoint's quantization_config.
        method: its quant_method.
        specs: the checkpoint's stored (name, shape, dtype) triples.

    Returns:
        None (also for a method not in CHECKED_METHODS). Raises NativeLayoutMismatch naming the
        first tensor that does not match (and how many more do not).
    """
    if method not in CHECKED_METHODS:
        return  # a layout rl-refit does not know: nothing to check it against
    by_name = {name: (name, tuple(shape), dtype) for name, shape, dtype in specs}
    found = list(_floating_claimed(qc, method, specs))
    if method in ("gptq", "awq"):
        found += _gptq_awq(qc, method, by_name)
    elif method == "mxfp4":
        found += _mxfp4(by_name)
    elif method in ("compressed-tensors", "fp8"):
        found += _scaled(by_name, method)
        if method == "compressed-tensors":
            found += _ct_bits(qc, by_name)
    if not found:
        return
    tensor, problem = found[0]
    more = f" ({len(found) - 1} more tensors do not match either)" if len(found) > 1 else ""
    raise NativeLayoutMismatch(tensor, f"{problem}{more}",
                               "the tensors are not the layout the config describes, and an engine loads them by it: "
                               "export from the checkpoint the config was written for, or fix its quantization_config "
                               "(for BF16 weights: remove it, or set hf_overrides.quantization_config=null)")
