"""An SGLang-shaped model served in this process, through rl-refit's custom loader: what `refit
bench refit` measures the loader's host backup on (the plugin's `backup`,
adapters.engine_plugin.InProcessBackup; app/bench/loader_backup.py).

The model is built from the exported stream: one parameter per checkpoint tensor, a quant method
per module whose post-processing moves the module's tensors into new storage (as SGLang's
kernel-layout post-processing does, which the loader copies back into the captured storage), and
what a refit never writes: a rotary cos/sin cache buffer and a frozen vision patch embedding.
`InProcessSglang` serves the four SGLang calls of a refit (the SglangClient seam) on it, and can
fail one update on purpose, after the loader's backup.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch
from torch import nn

from adapters.sglang import loader as refit_loader
from domain.refit.storage import StorageFingerprint

ROTARY_POSITIONS = 32768  # the cos/sin cache SGLang builds for a 32k context


class _RebindMethod:
    """Post-processing that moves the module's parameters into new storage, same values."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        for p in layer.parameters(recurse=False):
            p.data = p.data.clone()


class SglangShapedModel(nn.Module):
    """A module tree holding one parameter per exported tensor, plus what no refit sends."""

    def __init__(self, named: Iterator[tuple[str, torch.Tensor]], *, head_dim: int, hidden: int) -> None:
        super().__init__()
        for name, t in named:
            *path, local = name.split(".")
            module: nn.Module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, nn.Module())
                module = getattr(module, part)
            module.register_parameter(local, nn.Parameter(torch.zeros(t.shape, dtype=t.dtype), requires_grad=False))
            object.__setattr__(module, "quant_method", _RebindMethod())
        self.rotary_emb = nn.Module()
        self.rotary_emb.register_buffer("cos_sin_cache", torch.zeros(ROTARY_POSITIONS, head_dim, dtype=torch.float32))
        self.visual = nn.Module()
        self.visual.patch_embed = nn.Parameter(torch.zeros(hidden, 3, 14, 14, dtype=torch.bfloat16), requires_grad=False)

    fail_next = False  # the next load raises (after the loader's backup): an injected failure

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected load failure (refit bench)")
        params = dict(self.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t)

    def every_tensor(self) -> dict[str, torch.Tensor]:
        return dict(self.named_parameters()) | dict(self.named_buffers())


@attrs.define
class InProcessSglang:
    """The four SGLang calls of a refit, served in this process (the SglangClient seam)."""

    model: SglangShapedModel
    fail_at: int | None = None  # the update call (counted from 0) whose load fails
    calls: int = 0

    def begin_weight_update(self) -> tuple[bool, str]:
        return True, ""

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, torch.Tensor]], load_format: str,
                                   flush_cache: bool) -> tuple[bool, str]:
        self.model.fail_next = self.calls == self.fail_at
        self.calls += 1
        refit_loader.load(self.model, named_tensors)
        return True, ""

    def end_weight_update(self) -> tuple[bool, str]:
        for module in self.model.modules():  # SGLang's own pass; the loader's skip guards make it a no-op
            qm = getattr(module, "quant_method", None)
            if qm is not None:
                qm.process_weights_after_loading(module)
        return True, ""

    def storage_fingerprint(self) -> StorageFingerprint:
        return StorageFingerprint.of(self.model.every_tensor())

    def live_weights(self) -> Mapping[str, torch.Tensor]:
        return self.model.every_tensor()


@attrs.define
class Harness:
    """One SGLang engine over an SGLang-shaped model, in this process (InProcessBackup.harness)."""

    engine: Any  # SglangRolloutEngine over `client`
    client: InProcessSglang

    @property
    def updates(self) -> int:
        """The update calls so far (the BEGIN and FINAL markers are one each)."""
        return self.client.calls

    def fail_update(self, index: int) -> None:
        """The update call `index` (counted from 0 over the harness's life) fails after the backup."""
        self.client.fail_at = index

    def peak_backup_bytes(self) -> int:
        """The loader's peak host backup in the last refit."""
        loader = refit_loader.loader_for(self.client.model)
        if loader is None:
            raise RuntimeError("refit bench: the SGLang loader never ran on the in-process model")
        return loader.peak_backup_bytes

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer of the engine's model."""
        return self.client.model.every_tensor()


def harness(plan: Any, named_weights: Iterator[tuple[str, torch.Tensor]], *, head_dim: int, hidden: int) -> Harness:
    """An SGLang engine serving `plan` over a model shaped from the exported stream of `named_weights`."""
    from adapters.sglang.engine import SglangRolloutEngine
    from domain.quant.stream import quantize_stream

    model = SglangShapedModel(quantize_stream(plan, named_weights), head_dim=head_dim, hidden=hidden)
    client = InProcessSglang(model)
    return Harness(SglangRolloutEngine(client, plan), client)
