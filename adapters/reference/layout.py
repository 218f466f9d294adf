"""The reference engine's rollout-format layout: what it stores per fused module, and where each
checkpoint tensor of a refit lands.

Like vLLM's compressed-tensors layers, a quantized fused module (q/k/v, gate/up, stacked experts)
holds its checkpoint tensors fused along the rows: `weight` (E4M3) or `weight_packed` (FP4, two
per byte), `weight_scale` (float32 blocks, E8M0 or E4M3), and for NVFP4 one `weight_global_scale`
per module (per expert). While staging, the global scale keeps one slot per shard; post-processing
reduces the slots to their maximum (engines take the shard maximum and warn when they differ).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from adapters.reference.config import ReferenceModelConfig, hf_weight_shapes
from adapters.reference.model import Slot, fused_shapes, slot_table
from domain.errors import EngineTensorMismatch
from domain.quant.formats import BF16, PrecisionFormat, ScaleEncoding
from domain.quant.plan import QuantizationPlan
from domain.quant.stream import checkpoint_names

GLOBAL = "weight_global_scale"
_ROUTED = ("w13", "w2")


def tensor_specs(fmt: PrecisionFormat, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Checkpoint tensors of one weight of `shape` in `fmt`: local name -> (shape, dtype).

    Args:
        fmt: the preset (BF16 gives the weight itself).
        shape: the logical weight shape, [N, K] or [E, N, K].

    Returns:
        e.g. NVFP4 [N, K]: weight_packed u8 [N, K/2], weight_scale e4m3 [N, K/16],
        weight_global_scale f32 [1].
    """
    if not fmt.is_quantized:
        return {"weight": (shape, torch.bfloat16)}
    *lead, n, k = shape
    elem = (
        ((*lead, n, k // 2), torch.uint8) if fmt.packed else ((*lead, n, k), torch.float8_e4m3fn)
    )
    scale_dtype = {
        ScaleEncoding.FP32: torch.float32,
        ScaleEncoding.E8M0: torch.uint8,
        ScaleEncoding.E4M3_GLOBAL_FP32: torch.float8_e4m3fn,
    }[fmt.scale_encoding]
    specs = {fmt.weight_name: elem, "weight_scale": (fmt.scale_shape(shape), scale_dtype)}
    if fmt.scale_encoding is ScaleEncoding.E4M3_GLOBAL_FP32:
        specs[GLOBAL] = ((*lead, 1) if lead else (1,), torch.float32)
    return specs


@attrs.frozen
class ModuleSpec:
    """One fused module of the engine.

    Attributes:
        key: fused key (`layers.0.qkv`).
        format: its rollout preset.
        shape: logical shape of the fused weight.
        num_shards: members fused into it.
        live: local name -> (shape, dtype) of the live tensors.
        group: the commit group (`layers.N`, or the key itself outside the layers).
    """

    key: str
    format: PrecisionFormat
    shape: tuple[int, ...]
    num_shards: int
    live: dict[str, tuple[tuple[int, ...], torch.dtype]]
    group: str

    def staging(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shapes of the staging tensors: the live ones, with one global-scale slot per shard."""
        out = dict(self.live)
        if GLOBAL in out:
            shape, dtype = out[GLOBAL]
            out[GLOBAL] = ((*shape[:-1], self.num_shards), dtype)
        return out


@attrs.frozen
class Target:
    """Where one received checkpoint tensor goes.

    Attributes:
        key: the fused module.
        local: the module's tensor (`weight_packed`, `weight_scale`, ...).
        index: indexing into the staging tensor (expert, rows or the shard's global-scale slot).
        shape: the shape the received tensor must have.
        dtype: the dtype it must have.
    """

    key: str
    local: str
    index: tuple[Any, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype


def _group(key: str) -> str:
    parts = key.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else key


def _row_index(fmt: PrecisionFormat, slot: Slot, local: str, module: str) -> slice:
    if local == GLOBAL:
        return slice(slot.shard, slot.shard + 1)
    block_rows = fmt.block_size[0] if local == "weight_scale" else 1
    if slot.rows.start % block_rows:
        raise EngineTensorMismatch(
            f"{module}: its rows start at {slot.rows.start}, not a multiple of the {fmt.name} block "
            f"({block_rows}); a fused module cannot hold it. Keep it in BF16 with rollout.quantization.ignore"
        )
    return slice(slot.rows.start // block_rows, -(-slot.rows.stop // block_rows))


@attrs.frozen
class EngineLayout:
    """Every fused module and every checkpoint tensor a refit must deliver.

    Attributes:
        modules: fused key -> ModuleSpec, in layer order.
        targets: checkpoint name -> Target, in stream order.
    """

    modules: dict[str, ModuleSpec]
    targets: dict[str, Target]

    @classmethod
    def build(cls, cfg: ReferenceModelConfig, plan: QuantizationPlan) -> EngineLayout:
        """The layout the engine allocates for `cfg` served with `plan`.

        Args:
            cfg: the model configuration.
            plan: the rollout quantization plan.

        Returns:
            The layout. Raises EngineTensorMismatch when the members of a fused module get
            different formats, or a shard is not aligned to the format's row blocks.
        """
        slots = slot_table(cfg)
        shapes = dict(hf_weight_shapes(cfg))
        decisions = {m: plan.decide(f"{m}.weight", shapes[f"{m}.weight"]) for m in slots}
        formats: dict[str, PrecisionFormat] = {}
        shards: dict[str, int] = {}
        for m, slot in slots.items():
            fmt = decisions[m].format
            if formats.setdefault(slot.key, fmt) != fmt:
                raise EngineTensorMismatch(
                    f"{m}: format {fmt.name} differs from the other members of the fused module "
                    f"{slot.key} ({formats[slot.key].name}); ignore all of q/k/v (or gate/up) or none"
                )
            shards[slot.key] = slot.num_shards
        modules = {}
        for key, shape in fused_shapes(cfg).items():
            fmt = formats.get(key, BF16)
            modules[key] = ModuleSpec(key, fmt, shape, shards[key], tensor_specs(fmt, shape), _group(key))
        targets: dict[str, Target] = {}
        for m, slot in slots.items():
            d = decisions[m]
            hf_shape = shapes[f"{m}.weight"]
            specs = tensor_specs(d.format, hf_shape)
            for full in checkpoint_names(plan, d, hf_shape):
                local = full.rsplit(".", 1)[-1] if d.is_quantized else "weight"
                local = "weight_scale" if local == plan.scale_name else local
                shape, dtype = specs[local]
                rows = _row_index(d.format, slot, local, m)
                index = (rows,) if slot.expert is None else (slot.expert, rows)
                targets[full] = Target(slot.key, local, index, shape, dtype)
        return cls(modules, targets)

    def groups(self) -> dict[str, tuple[str, ...]]:
        """Commit group -> the checkpoint names it needs, in stream order."""
        out: dict[str, list[str]] = {}
        for name, t in self.targets.items():
            out.setdefault(self.modules[t.key].group, []).append(name)
        return {g: tuple(v) for g, v in out.items()}

    def live_bytes(self) -> int:
        return sum(_nbytes(s, d) for m in self.modules.values() for s, d in m.live.values())


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def is_routed(key: str) -> bool:
    """True for stacked expert modules (they take the plan's MoE activation scheme)."""
    return key.rsplit(".", 1)[-1] in _ROUTED
