"""LoRA on Megatron-Core's parallel linears, read out as a `domain.lora.LoraAdapter` in Hugging Face names.

`MegatronLora.attach(model, r=..., lora_alpha=...)` puts a LoRA branch on every targeted
`ColumnParallelLinear` / `RowParallelLinear` of a GPTModel (`linear_qkv`, `linear_proj`,
`linear_fc1`, `linear_fc2` by default) through a forward hook: the model's modules and state dict
stay as they are, so the existing exporters (`adapters.megatron.hf_names`) still read the base
weights, and the adapter's parameters live in the `MegatronLora` (`parameters()` for the
optimizer). A fused linear gets one LoRA per slice, as PEFT has on the unfused Hugging Face model
and as inference engines pack it: `linear_qkv` one per q/k/v, a gated `linear_fc1` one per
gate/up (`lora_A` [slices, r, K], `lora_B` [rows, r] in Megatron's row order). The branch
computes PEFT's `lora_B(lora_A(x)) * scaling`, with `scaling = lora_alpha / r` (or
`/ sqrt(r)` with rsLoRA).

`adapter()` names every slice the way PEFT names its modules (`model.layers.N.self_attn.q_proj`,
..., `mlp.down_proj`), splitting rows with the same maps as the base weights (`hf_parts` applied
to row indices); `load(adapter)` is the inverse. A column-parallel branch holds the rank's rows
of `lora_B` (`lora_A` replicated); a row-parallel one the rank's columns of `lora_A` (`lora_B`
replicated), with the rank-r activations all-reduced. On tensor-parallel ranks `adapter()` gathers
the shards and `load()` takes them (a rank's rows of q, k, v, gate and up are a contiguous chunk
of each); with pipeline stages each stage would read its own layers (not tested). Sequence parallelism and `gather_output`
are refused.

Megatron-Bridge's PEFT (`megatron.bridge.peft.lora.LoRA`; not installed here, so this reads its
published code and was not run) wraps the same linears (`to_wrap`) with `linear_in` /
`linear_out` adapters and can be a source later: read those two weights per
wrapped module and split the rows with the same `hf_parts` maps. What it takes: Megatron-Bridge
in the trainer's environment, a map of its module names (its wrapper renames the base linear's
parameters, so the base stream needs the prefix removed), and its fused layout: by default one
`linear_in` is shared by q/k/v (and gate/up), which in PEFT's names means the three modules get
the same `lora_A`; the merged mode is unaffected, the adapter mode then sends that A per slice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import attrs
import torch

from adapters.megatron.hf_names import hf_parts
from domain.lora import LoraAdapter, LoraShapeMismatch, LoraUnknownTarget, LoraUnsupported, LoraWeights

DEFAULT_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


class LoraBranch(torch.nn.Module):
    """The LoRA of one parallel linear: one (lora_A, rows of lora_B) per slice of its output rows.

    Args:
        parallel: "column" or "row".
        rows: per slice, the indices of its rows in the linear's (local) output.
        in_features: the linear's local input width.
        out_features: its local output height.
        r, scaling: the adapter's rank and scaling.
        dtype: the parameters' dtype.
    """

    order: torch.Tensor  # output position -> position in the slices' concatenation

    def __init__(self, parallel: str, rows: list[torch.Tensor], in_features: int, out_features: int, r: int,
                 scaling: float, dtype: torch.dtype, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.parallel = parallel
        self.scaling = scaling
        # PEFT's default: kaiming-uniform A (bound 1/sqrt(fan_in)), zero B. A seeded generator
        # gives every tensor-parallel rank the same replicated A of a column-parallel branch.
        bound = 1 / math.sqrt(in_features)
        a = torch.rand(len(rows), r, in_features, generator=generator, dtype=torch.float32) * (2 * bound) - bound
        self.lora_A = torch.nn.Parameter(a.to(dtype))
        self.lora_B = torch.nn.Parameter(torch.zeros(out_features, r, dtype=dtype))
        self.rows = [r_.clone() for r_ in rows]
        self.register_buffer("order", torch.argsort(torch.cat(self.rows)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        if self.parallel == "row":
            h = reduce_from_tensor_model_parallel_region(x @ self.lora_A[0].t())
            return (h @ self.lora_B.t()) * self.scaling
        # the rank-r activations are replicated: their gradient is all-reduced over the rank's
        # rows of lora_B, so the replicated lora_A gets the whole gradient on every rank
        parts = [copy_to_tensor_model_parallel_region(x @ self.lora_A[s].t()) @ self.lora_B[rows].t()
                 for s, rows in enumerate(self.rows)]
        return torch.cat(parts, dim=-1)[..., self.order] * self.scaling


def _parallel(module: torch.nn.Module, name: str) -> str:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if getattr(module, "sequence_parallel", False):
        raise LoraUnsupported(name, "sequence parallelism is not supported by the LoRA wrapper",
                              "set sequence_parallel=False")
    if isinstance(module, ColumnParallelLinear):
        if getattr(module, "gather_output", False):
            raise LoraUnsupported(name, "gather_output=True is not supported", "wrap linears that keep their shard")
        return "column"
    if isinstance(module, RowParallelLinear):
        return "row"
    raise LoraUnsupported(name, f"{type(module).__name__} is not a ColumnParallelLinear or RowParallelLinear",
                          "use the local layer spec (Transformer Engine linears are not wrapped yet)")


def _tp() -> tuple[int, int, Any]:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1, None
    return (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_group())


def _gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The tensor-parallel ranks' shards of `t`, concatenated along `dim` in rank order."""
    _, size, group = _tp()
    if size == 1:
        return t
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _shard(w: LoraWeights, parallel: str) -> LoraWeights:
    """This tensor-parallel rank's part of a whole module's adapter."""
    rank, size, _ = _tp()
    if size == 1:
        return w
    if parallel == "column":
        return LoraWeights(w.lora_A, w.lora_B.chunk(size, dim=0)[rank])
    return LoraWeights(w.lora_A.chunk(size, dim=1)[rank], w.lora_B)


def _hook(branch: LoraBranch) -> Any:
    def hook(module: torch.nn.Module, inputs: tuple[Any, ...], output: Any) -> Any:
        out, bias = output
        return out + branch(inputs[0]).to(out.dtype), bias
    return hook


@attrs.define
class MegatronLora:
    """LoRA branches on a Megatron GPTModel's parallel linears (see the module docstring).

    Attributes:
        model: the GPTModel (unwrapped).
        r, lora_alpha, use_rslora: the adapter's configuration.
        branches: Megatron module name -> its branch.
    """

    model: torch.nn.Module
    r: int
    lora_alpha: float
    use_rslora: bool
    branches: dict[str, LoraBranch]
    _handles: list[Any] = attrs.field(factory=list)

    @classmethod
    def attach(cls, model: torch.nn.Module, *, r: int, lora_alpha: float, targets: Iterable[str] = DEFAULT_TARGETS,
               use_rslora: bool = False, seed: int = 0) -> MegatronLora:
        """Put a LoRA branch on every parallel linear whose last name component is in `targets`.

        `lora_A` is drawn from a generator seeded with `seed` (the same on every rank), `lora_B`
        is zero, as PEFT initializes it: the model computes as before until the adapter trains.

        Raises:
            LoraUnsupported: a targeted module is not a supported parallel linear.
            LoraUnknownTarget: no module matched.
        """
        targets = tuple(targets)
        scaling = lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r
        lora = cls(model=model, r=r, lora_alpha=lora_alpha, use_rslora=use_rslora, branches={})
        generator = torch.Generator().manual_seed(seed)
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] not in targets:
                continue
            parallel = _parallel(module, name)
            weight = module.weight
            rows = [idx for _, idx in hf_parts(model, f"{name}.weight", torch.arange(weight.shape[0]))]
            branch = LoraBranch(parallel, rows if parallel == "column" else [torch.arange(weight.shape[0])],
                                weight.shape[1], weight.shape[0], r, scaling, weight.dtype, generator)
            lora.branches[name] = branch
            lora._handles.append(module.register_forward_hook(_hook(branch)))
        if not lora.branches:
            raise LoraUnknownTarget(",".join(targets), "no parallel linear of the model has this name")
        return lora

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The adapter's trainable parameters (for the optimizer)."""
        for branch in self.branches.values():
            yield from branch.parameters()

    def detach(self) -> None:
        """Remove the hooks: the model computes without the adapter again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _slices(self, name: str) -> Iterator[tuple[int, str, torch.Tensor]]:
        branch = self.branches[name]
        rows = torch.arange(branch.lora_B.shape[0])
        for s, (hf, idx) in enumerate(hf_parts(self.model, f"{name}.weight", rows)):
            yield (s if branch.parallel == "column" else 0), hf.removesuffix(".weight"), idx

    def adapter(self) -> LoraAdapter:
        """The whole adapter in PEFT's Hugging Face module names (detached copies).

        On a tensor-parallel rank the shards are gathered over the tensor-parallel group (every
        rank of the group must call it): a column-parallel slice's `lora_B` rows, a row-parallel
        `lora_A`'s columns.
        """
        modules: dict[str, LoraWeights] = {}
        for name, branch in self.branches.items():
            for s, hf, idx in self._slices(name):
                a, b = branch.lora_A[s].detach(), branch.lora_B[idx].detach()
                if branch.parallel == "column":
                    b = _gather(b, dim=0)
                else:
                    a = _gather(a, dim=1)
                modules[hf] = LoraWeights(a.clone(), b.clone())
        targets = sorted({m.rsplit(".", 1)[-1] for m in modules})
        return LoraAdapter(r=self.r, lora_alpha=self.lora_alpha, target_modules=tuple(targets), modules=modules,
                           use_rslora=self.use_rslora)

    @torch.no_grad()
    def load(self, adapter: LoraAdapter) -> None:
        """Copy a whole adapter in Hugging Face names into the branches; slices it leaves out get
        zeros. On a tensor-parallel rank each branch takes its shard (the rank's rows of a
        column-parallel `lora_B`, its columns of a row-parallel `lora_A`).

        Raises:
            LoraUnsupported: the adapter's r, lora_alpha or rsLoRA differ from the branches'.
            LoraShapeMismatch: a module's tensors do not fit its slice.
            LoraUnknownTarget: a module of the adapter has no branch.
        """
        if (adapter.r, adapter.lora_alpha, adapter.use_rslora) != (self.r, self.lora_alpha, self.use_rslora):
            raise LoraUnsupported("*", f"adapter r={adapter.r} lora_alpha={adapter.lora_alpha} rslora="
                                  f"{adapter.use_rslora}, the branches have r={self.r} lora_alpha={self.lora_alpha} "
                                  f"rslora={self.use_rslora}", "attach with the adapter's configuration")
        used = set()
        for name, branch in self.branches.items():
            for s, hf, idx in self._slices(name):
                w = adapter.modules.get(hf)
                if w is None:
                    branch.lora_A[s].zero_()
                    branch.lora_B[idx] = 0
                    continue
                w = _shard(w, branch.parallel)
                if w.lora_A.shape != branch.lora_A[s].shape or w.lora_B.shape != (len(idx), self.r):
                    raise LoraShapeMismatch(hf, f"lora_A {tuple(w.lora_A.shape)} / lora_B {tuple(w.lora_B.shape)} "
                                            f"do not fit {name}'s slice ({tuple(branch.lora_A[s].shape)}, "
                                            f"{(len(idx), self.r)})", "load the adapter of this model")
                branch.lora_A[s].copy_(w.lora_A)
                branch.lora_B[idx] = w.lora_B.to(branch.lora_B.dtype)
                used.add(hf)
        unknown = sorted(set(adapter.modules) - used)
        if unknown:
            raise LoraUnknownTarget(unknown[0], "the Megatron model has no LoRA branch for this module",
                                    "attach with targets that cover it")
