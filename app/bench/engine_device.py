"""`refit bench engine --device DEV`: refits into the embedded reference engine on DEV, the trainer's
weights on DEV too, against a `copy_` of the same bytes on DEV (device to device), measured in the
same run. No engine server: what it measures is rl-refit's own path (export, quantize, buckets, staging,
commit, checks) on the device, bounded by the device's copy rate."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from app.bench.report import BenchReport
from domain.errors import ConfigError

PRESETS = ("BF16", "FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4")
COPY_D2D = "copy_ of the same bytes on the device (device to device: the bound)"


@attrs.frozen
class DeviceBenchSettings:
    """What `refit bench engine --device` measures.

    Attributes:
        device: cpu, cuda or cuda:N.
        model: the embedded model preset.
        preset: the rollout plan, linear and MoE alike.
        repeat: measured refits (the median is reported).
        bucket_mb: bucket size, MiB.
    """

    device: str
    model: str = "micro-moe"
    preset: str = "BF16"
    repeat: int = 3
    bucket_mb: float = 1.0

    def __attrs_post_init__(self) -> None:
        if self.preset.upper() not in PRESETS:
            raise ConfigError("--preset", f"the embedded engine takes {', '.join(PRESETS)}, got {self.preset!r}")
        if self.repeat < 1:
            raise ConfigError("--repeat", f"must be >= 1, got {self.repeat}")
        where = torch.device(self.device)
        if where.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device", f"{self.device}: this torch sees no CUDA device; use --device cpu")
        if where.type not in ("cpu", "cuda"):
            raise ConfigError("--device", f"{self.device}: use cpu, cuda or cuda:N")


def synchronizer(device: torch.device) -> Callable[[], None]:
    """What makes a wall-clock timing on `device` honest: a GPU's queued work done; nothing on the host."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def copy_bound(tensors: list[torch.Tensor], repeat: int, sync: Callable[[], None]) -> float:
    """Median seconds of one `copy_` of every tensor into a resident buffer on its device (a warm-up first)."""
    flat = [t.detach().reshape(-1).view(torch.uint8) for t in tensors if t.is_contiguous() and t.numel()]
    out = {t.device: torch.empty(max(f.numel() for f in flat if f.device == t.device), dtype=torch.uint8,
                                 device=t.device) for t in flat}

    def once() -> None:
        for f in flat:
            out[f.device][: f.numel()].copy_(f)

    once()
    return statistics.median(_timed(once, sync) for _ in range(repeat))


def run(settings: DeviceBenchSettings) -> BenchReport:
    """Refit the embedded model `repeat` times into the engine on the device; the report's rows:
    the refit's throughput against the device-to-device copy of the same bytes."""
    from app.bootstrap import bootstrap
    from app.logging import configure_logging

    configure_logging(level=logging.WARNING)  # the canonical refit lines would flood the table
    device = torch.device(settings.device)
    preset = None if settings.preset.upper() == "BF16" else settings.preset.upper()
    services = bootstrap({"reference": {"model": settings.model, "device": str(device)},
                          "rollout": {"quantization": {"linear": preset, "moe": preset},
                                      "checkpoint_engine": {"update_weights_bucket_megabytes": settings.bucket_mb}}})
    trainer: Any = services.trainer_model()
    trainer.weights = {k: v.to(device) for k, v in trainer.weights.items()}  # the trainer's weights on the device
    svc = services.refit_service(trainer=trainer)
    sync = synchronizer(device)
    first = svc.refit()  # warm-up: the engine goes live, buffers and kernels are made
    seconds = [_timed(svc.refit, sync) for _ in range(settings.repeat)]
    reports = svc.reports[-settings.repeat:]
    copy_s = copy_bound([t for _, t in trainer.named_weights()], settings.repeat, sync)
    ours = statistics.median(seconds)
    gbytes = first.source_bytes / 1e9
    case = f"{settings.model} {settings.preset.upper()} embedded engine on {device} bucket {settings.bucket_mb:g} MiB"
    report = BenchReport("engine")
    report.add(case, "rl-refit refit throughput (BF16 source bytes)", gbytes / ours, "GB/s", COPY_D2D, gbytes / copy_s)
    report.notes.append(f"refit {ours * 1e3:.1f} ms (median of {settings.repeat}); copy_ of the same "
                        f"{first.source_bytes / 2**20:.1f} MiB on {device}: {copy_s * 1e3:.2f} ms")
    phases = {k: statistics.median(r.timings.get(k, 0.0) for r in reports) for k in reports[0].timings}
    report.notes.append("where the time goes (median per phase): " +
                        ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in phases.items()))
    storage = all(r.storage.ok for r in reports)
    report.notes.append(f"captured storage kept on every refit: {storage}; outcome {reports[-1].outcome.value}")
    return report
