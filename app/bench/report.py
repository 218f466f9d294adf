"""Benchmark report: rows of measured values with the baseline measured in the same run."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch


def machine_description() -> dict[str, Any]:
    """What the figures were measured on."""
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": mem_gib,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "platform": platform.platform(),
    }


@attrs.define
class BenchRow:
    case: str
    metric: str
    value: float
    unit: str
    baseline: str | None = None
    baseline_value: float | None = None
    # Optional plotting hints for `refit bench all` (app/bench/figures.py); inferred when None.
    figure: str | None = None  # which figure the row belongs to: throughput, memory, bucket, mismatch
    preset: str | None = None  # the precision preset the row measures (FP8_BLOCK, ...), for grouping
    x: float | None = None  # a numeric sweep coordinate, e.g. the bucket size in MiB

    @property
    def ratio(self) -> float | None:
        """How many times better than the baseline (higher is better for throughputs)."""
        if self.baseline_value in (None, 0) or self.value == 0:
            return None
        if self.unit.endswith("/s"):
            return self.value / self.baseline_value
        return self.baseline_value / self.value  # times, bytes: smaller is better

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["ratio"] = self.ratio
        return d


@attrs.define
class BenchReport:
    suite: str
    rows: list[BenchRow] = attrs.field(factory=list)
    notes: list[str] = attrs.field(factory=list)
    machine: dict[str, Any] = attrs.field(factory=machine_description)

    def add(self, *args: Any, **kwargs: Any) -> BenchRow:
        row = BenchRow(*args, **kwargs)
        self.rows.append(row)
        return row

    def to_dict(self) -> dict[str, Any]:
        return {
            "suite": self.suite,
            "machine": self.machine,
            "rows": [r.to_dict() for r in self.rows],
            "notes": self.notes,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def measure_interleaved(fns: Mapping[str, Callable[[], object]], *, repeat: int = 5, warmup: int = 1) -> dict[str, float]:
    """Median wall-clock seconds of each of `fns`, run in turns (the order reversed every round), so
    that a load change on a shared machine hits every candidate alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    for i in range(repeat):
        for name in order if i % 2 == 0 else reversed(order):
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def measure(fn: Callable[[], object], *, repeat: int = 5, warmup: int = 1) -> float:
    """Median wall-clock seconds of `fn()` over `repeat` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
