"""Host memory of an SGLang-style transactional refit: the custom loader's backup against its bound.

The refit runs through SglangRolloutEngine and SGLang's custom loader of this library
(adapters.sglang.loader) in process, on an SGLang-shaped model built from the exported stream: one
parameter per checkpoint tensor, a quant method per module whose post-processing moves the
module's tensors into new storage (as SGLang's kernel-layout post-processing does, which the
loader copies back into the captured storage), and what a refit never writes: a rotary cos/sin
cache buffer and a frozen vision patch embedding.

Rows, for each plan:
- peak host backup of a refit, against the bound: the bytes of the engine tensors the refit
  overwrites (every parameter it loads or post-processes), counted from the model, not from the
  loader;
- the same peak against what the previous loader copied at BEGIN (every parameter and buffer);
- peak host backup of a refit that fails at its middle bucket, against the bytes of the tensors
  delivered up to it plus one decoder layer (the loader backs up a whole layer before writing
  into it): the backup grows with the refit, it is not taken up front.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import attrs
import structlog
import structlog.testing
import torch
from torch import nn

from adapters.reference.config import preset
from adapters.reference.trainer import ReferenceTrainer
from adapters.sglang import loader as refit_loader
from adapters.sglang.engine import SglangRolloutEngine
from app.bench.report import BenchReport
from app.services.refit import RefitService
from domain.errors import RefitFailed
from domain.quant import naming
from domain.quant.plan import QuantizationPlan
from domain.quant.stream import quantize_stream
from domain.refit.buckets import Bucket
from domain.refit.storage import StorageFingerprint

MiB = 2**20
ROTARY_POSITIONS = 32768  # the cos/sin cache SGLang builds for a 32k context
PREVIOUS = "BEGIN copy of every parameter and buffer (previous loader)"


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


def _plans() -> dict[str, QuantizationPlan]:
    # SGLang serves neither per-token NVFP4 nor MXFP8 linear with MXFP4 experts (dispatch rule EngineSupportMatrix).
    return {"BF16": QuantizationPlan.bf16(), "FP8_BLOCK/MXFP4": QuantizationPlan.from_presets("FP8_BLOCK", "MXFP4")}


def _bytes(model: SglangShapedModel, names: set[str]) -> int:
    every = model.every_tensor()
    return sum(every[n].nbytes for n in names)


def _largest_layer(model: SglangShapedModel) -> int:
    per_layer: dict[int, int] = {}
    for name, t in model.every_tensor().items():
        if (layer := naming.layer_index(name)) is not None:
            per_layer[layer] = per_layer.get(layer, 0) + t.nbytes
    return max(per_layer.values(), default=0)


class _Recording:
    """The engine, recording the tensors its buckets deliver (a failing bucket's included)."""

    def __init__(self, engine: SglangRolloutEngine) -> None:
        self._engine = engine
        self.names: set[str] = set()

    def load_bucket(self, bucket: Bucket) -> None:
        self.names.update(m.name for m in bucket.metas)
        self._engine.load_bucket(bucket)

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)


@attrs.frozen
class _Measured:
    loader: refit_loader.RefitLoader
    model: SglangShapedModel
    delivered: set[str]
    failed: bool


def _measure(trainer: ReferenceTrainer, plan: QuantizationPlan, bucket_mb: float, *, fail: bool) -> _Measured:
    cfg = trainer.config
    model = SglangShapedModel(quantize_stream(plan, trainer.named_weights()), head_dim=cfg.head_dim,
                              hidden=cfg.hidden_size)
    client = InProcessSglang(model)
    engine = _Recording(SglangRolloutEngine(client, plan))
    service = RefitService(trainer, engine, plan, bucket_bytes=int(bucket_mb * MiB))  # type: ignore[arg-type]
    service.refit()  # the first refit makes the engine live; the measured one follows
    buckets = client.calls - 2  # one call per bucket between the BEGIN and FINAL markers
    if fail:
        client.fail_at = client.calls + 1 + buckets // 2
    engine.names = set()
    failed = False
    try:
        with structlog.testing.capture_logs():  # the injected failure's warnings are expected: keep them out
            service.refit()
    except RefitFailed:  # the injected failure: the loader restored the live weights
        failed = True
    loader = refit_loader.loader_for(model)
    if loader is None or failed is not fail:
        raise RuntimeError("refit bench: the SGLang-style refit did not run as set up")
    return _Measured(loader, model, engine.names, failed)


def rows(report: BenchReport, model_name: str, bucket_mb: float) -> None:
    """Add the SGLang backup rows for `model_name` (a reference preset) to `report`."""
    trainer = ReferenceTrainer.from_seed(preset(model_name))
    for label, plan in _plans().items():
        case = f"{model_name} {label} sglang transactional bucket {bucket_mb:g} MiB"
        full = _measure(trainer, plan, bucket_mb, fail=False)
        peak = full.loader.peak_backup_bytes
        report.add(case, "peak host backup (SGLang loader)", peak / MiB, "MiB",
                   "bound: bytes the refit overwrites", _bytes(full.model, full.delivered) / MiB,
                   figure="memory", preset=label)
        everything = sum(t.nbytes for t in full.model.every_tensor().values())
        report.add(case, "peak host backup vs the previous BEGIN copy", peak / MiB, "MiB", PREVIOUS,
                   everything / MiB, preset=label)
        half = _measure(trainer, plan, bucket_mb, fail=True)
        bound = _bytes(half.model, half.delivered) + _largest_layer(half.model)
        report.add(case + ", failing at the middle bucket", "peak host backup (SGLang loader)",
                   half.loader.peak_backup_bytes / MiB, "MiB", "bound: bytes delivered + one layer", bound / MiB,
                   preset=label)
