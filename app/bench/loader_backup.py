"""Host memory of a transactional refit into an engine whose loader backs up what it overwrites:
the backup's peak against its bound, for every engine whose plugin serves such a loader in this
process (adapters.engine_plugin.InProcessBackup; docs/architecture.md#engine-plugins).

The refit runs through the engine's adapter and its loader in process, on a model shaped like the
engine's, built from the exported stream (with what a refit never writes beside it).

Rows, for each engine and plan:
- peak host backup of a refit, against the bound: the bytes of the engine tensors the refit
  overwrites (every parameter it loads or post-processes), counted from the model, not from the
  loader;
- the same peak against what the previous loader copied at BEGIN (every parameter and buffer);
- peak host backup of a refit that fails at its middle bucket, against the bytes of the tensors
  delivered up to it plus one decoder layer (the loader backs up a whole layer before writing
  into it): the backup grows with the refit, it is not taken up front.
"""

from __future__ import annotations

from typing import Any

import attrs
import structlog.testing

from adapters.engine_plugin import InProcessBackup
from adapters.plugins import PLUGINS
from adapters.reference.config import preset
from adapters.reference.trainer import ReferenceTrainer
from app.bench.report import BenchReport
from app.services.refit import RefitService
from domain.errors import RefitFailed
from domain.quant import naming
from domain.quant.plan import QuantizationPlan
from domain.refit.buckets import Bucket

MiB = 2**20
PREVIOUS = "BEGIN copy of every parameter and buffer (previous loader)"


def backups() -> dict[str, InProcessBackup]:
    """rollout.name -> its in-process loader backup, for every plugin that has one."""
    return {name: plugin.backup() for name, plugin in PLUGINS.items() if plugin.backup is not None}


def _bytes(tensors: dict[str, Any], names: set[str]) -> int:
    return sum(tensors[n].nbytes for n in names)


def _largest_layer(tensors: dict[str, Any]) -> int:
    per_layer: dict[int, int] = {}
    for name, t in tensors.items():
        if (layer := naming.layer_index(name)) is not None:
            per_layer[layer] = per_layer.get(layer, 0) + t.nbytes
    return max(per_layer.values(), default=0)


class _Recording:
    """The engine, recording the tensors its buckets deliver (a failing bucket's included)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.names: set[str] = set()

    def load_bucket(self, bucket: Bucket) -> None:
        self.names.update(m.name for m in bucket.metas)
        self._engine.load_bucket(bucket)

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)


@attrs.frozen
class _Measured:
    peak: int
    tensors: dict[str, Any]
    delivered: set[str]


def _measure(backup: InProcessBackup, trainer: ReferenceTrainer, plan: QuantizationPlan, bucket_mb: float, *,
             fail: bool) -> _Measured:
    cfg = trainer.config
    harness = backup.harness(plan, trainer.named_weights(), head_dim=cfg.head_dim, hidden=cfg.hidden_size)
    engine = _Recording(harness.engine)
    service = RefitService(trainer, engine, plan, bucket_bytes=int(bucket_mb * MiB))  # type: ignore[arg-type]
    service.refit()  # the first refit makes the engine live; the measured one follows
    buckets = harness.updates - 2  # one call per bucket between the BEGIN and FINAL markers
    if fail:
        harness.fail_update(harness.updates + 1 + buckets // 2)
    engine.names = set()
    failed = False
    try:
        with structlog.testing.capture_logs():  # the injected failure's warnings are expected: keep them out
            service.refit()
    except RefitFailed:  # the injected failure: the loader restored the live weights
        failed = True
    if failed is not fail:
        raise RuntimeError(f"refit bench: the {backup.name} refit did not run as set up")
    return _Measured(harness.peak_backup_bytes(), harness.tensors(), engine.names)


def rows(report: BenchReport, model_name: str, bucket_mb: float) -> None:
    """Add every engine's loader backup rows for `model_name` (a reference preset) to `report`,
    and each engine's note."""
    trainer = ReferenceTrainer.from_seed(preset(model_name))
    for name, backup in backups().items():
        metric = f"peak host backup ({backup.name} loader)"
        for label, (linear, moe) in backup.plans.items():
            plan = QuantizationPlan.from_presets(linear, moe)
            case = f"{model_name} {label} {name} transactional bucket {bucket_mb:g} MiB"
            full = _measure(backup, trainer, plan, bucket_mb, fail=False)
            report.add(case, metric, full.peak / MiB, "MiB", "bound: bytes the refit overwrites",
                       _bytes(full.tensors, full.delivered) / MiB, figure="memory", preset=label)
            everything = sum(t.nbytes for t in full.tensors.values())
            report.add(case, "peak host backup vs the previous BEGIN copy", full.peak / MiB, "MiB", PREVIOUS,
                       everything / MiB, preset=label)
            half = _measure(backup, trainer, plan, bucket_mb, fail=True)
            bound = _bytes(half.tensors, half.delivered) + _largest_layer(half.tensors)
            report.add(case + ", failing at the middle bucket", metric, half.peak / MiB, "MiB",
                       "bound: bytes delivered + one layer", bound / MiB, preset=label)
        report.notes.append(f"{name} rows: {backup.note}")
