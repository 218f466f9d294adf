"""The figures of `refit bench all`, derived from the suites' BenchReport rows.

Each row lands in at most one figure. A suite may say which with `BenchRow.figure` (and
`preset`, `x`); otherwise the figure is inferred from the suite, unit and metric:

- `throughput`: throughputs (`.../s`) with a baseline: ours / baseline per preset, one bar per
  baseline, one panel per suite;
- `memory`: bytes with a baseline in the `logprobs` suite (or a metric naming log-probs, or rows
  marked `memory`): the baseline's peak memory / ours, per case, one panel per suite;
- `bucket`: rows with a sweep coordinate `x` (the bucket size in MiB), or marked `bucket` (then a
  size written in the case name, `64 MiB`, serves as `x`): throughput and memory ratios against
  the bucket size;
- `mismatch`: mismatch metrics (k3 KL, log-prob difference, importance ratio) per preset;
- `other`: any other row with a ratio, so that no measurement is dropped from the pictures.

Every figure plots a ratio against a baseline measured in the same run (1.0 is drawn), except
`mismatch` rows without a baseline, which plot the value itself; every figure carries a line
describing the machine.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from app.bench.report import BenchRow

PRESETS = ("FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4", "BF16")
BYTE_UNITS = {"B": 1, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 1e3, "MB": 1e6, "GB": 1e9}
_MISMATCH = re.compile(r"\bk3\b|\bkl\b|mismatch|logp|log-prob diff|importance|prob diff", re.IGNORECASE)
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(KiB|MiB|GiB|KB|MB|GB)\b")


@attrs.frozen
class FigureSpec:
    """One figure of the report: its key (file `bench-<key>.png`), title and what it shows."""

    key: str
    title: str
    description: str


FIGURES: dict[str, FigureSpec] = {
    f.key: f
    for f in (
        FigureSpec("throughput", "Throughput per preset against each baseline",
                   "ours / baseline throughput (higher is better); one panel per suite, one bar per baseline"),
        FigureSpec("memory", "Peak memory against each baseline (baseline / ours)",
                   "how many times less memory than the baseline (fused log-probs against the plain "
                   "[tokens, vocab] path; a refit against its bound, where 1.0 means exactly at the bound)"),
        FigureSpec("bucket", "Refit throughput and peak memory against bucket size",
                   "ratios against the same-run baseline as the bucket grows (x: bucket MiB, log scale)"),
        FigureSpec("mismatch", "Train-rollout mismatch per preset",
                   "mismatch metrics per preset; ratio against the baseline arm where the suite measured one"),
        FigureSpec("other", "Other measurements against their baselines",
                   "ratio against the same-run baseline (higher is better) of rows no other figure shows"),
    )
}


def preset_of(row: BenchRow) -> str | None:
    """The row's preset: `row.preset`, else the first preset name that appears in its case."""
    if row.preset:
        return row.preset
    return next((p for p in PRESETS if re.search(rf"\b{p}\b", row.case)), None)


def bucket_mib(row: BenchRow) -> float | None:
    """The row's bucket size in MiB: `row.x`, else a size written in its case (`bucket 64 MiB`)."""
    if row.x is not None:
        return float(row.x)
    m = _SIZE.search(row.case)
    return float(m.group(1)) * BYTE_UNITS[m.group(2)] / 2**20 if m else None


def classify(suite: str, row: BenchRow) -> str | None:
    """Which figure a row belongs to (a FIGURES key), or None when it only goes in the tables."""
    if row.figure:
        return row.figure if row.figure in FIGURES else "other"
    text = f"{row.metric} {row.case}"
    if _MISMATCH.search(row.metric):
        return "mismatch"
    if row.x is not None and row.ratio is not None:  # a sweep coordinate: the bucket size
        return "bucket"
    if row.unit in BYTE_UNITS and row.ratio is not None and (suite == "logprobs" or "log-prob" in text
                                                              or "logprob" in text):
        return "memory"
    if row.unit.endswith("/s") and row.ratio is not None:
        return "throughput"
    return "other" if row.ratio is not None else None


def group_rows(reports: Mapping[str, Sequence[BenchRow]]) -> dict[str, list[tuple[str, BenchRow]]]:
    """(suite, row) pairs per figure key, in suite and row order; figures without rows are absent."""
    out: dict[str, list[tuple[str, BenchRow]]] = {}
    for suite, rows in reports.items():
        for row in rows:
            key = classify(suite, row)
            if key is not None:
                out.setdefault(key, []).append((suite, row))
    return out


def machine_line(machine: Mapping[str, Any]) -> str:
    """One line describing the machine (cores, memory, torch, GPU, load) for captions and reports."""
    gpu = machine.get("cuda") or "no GPU"
    load = machine.get("load_average_before")
    return (f"{machine.get('cpu_count')} cores ({machine.get('torch_threads')} torch threads), "
            f"{machine.get('memory_gib')} GiB, torch {machine.get('torch')}, Python {machine.get('python')}, {gpu}"
            + ("" if load is None else f", load average {load}"))


def _label(suite: str, row: BenchRow) -> str:
    return preset_of(row) or row.case


def _bars(ax: Any, items: Sequence[tuple[str, str, float]], ylabel: str, *, unit_line: bool) -> None:
    """Grouped bars: items are (group on the x axis, series, height)."""
    groups = list(dict.fromkeys(g for g, _, _ in items))
    series = list(dict.fromkeys(s for _, s, _ in items))
    width = min(0.8 / max(len(series), 1), 0.35)
    for j, name in enumerate(series):
        xs, hs = [], []
        for g, s, h in items:
            if s == name:
                xs.append(groups.index(g) + (j - (len(series) - 1) / 2) * width)
                hs.append(h)
        bars = ax.bar(xs, hs, width, label=name)
        ax.bar_label(bars, labels=[f"{h:.3g}" for h in hs], fontsize=7, padding=1)
    width_chars = max(8, 88 // max(len(groups), 1))  # wrap long case names to their slot
    ax.set_xticks(range(len(groups)), [textwrap.fill(g, width_chars) for g in groups], fontsize=8)
    ax.set_xlim(-0.6, len(groups) - 0.4)
    positive = [h for _, _, h in items if h > 0]
    if positive and max(positive) / min(positive) > 50:
        ax.set_yscale("log")
        ax.set_ylim(min(min(positive), 1.0) / 2, max(max(positive), 1.0) * 4)  # room for the labels
    elif positive:
        ax.set_ylim(0, max(max(positive), 1.0 if unit_line else 0.0) * 1.2)
    if unit_line:
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _panels(n: int, plt: Any, height: float = 3.2) -> tuple[Any, list[Any]]:
    fig, axes = plt.subplots(n, 1, figsize=(11, height * n + 0.8), squeeze=False)
    return fig, [a[0] for a in axes]


def _draw_bars_by_suite(rows: list[tuple[str, BenchRow]], plt: Any, series_of: Any, ylabel: str) -> Any:
    suites = list(dict.fromkeys(s for s, _ in rows))
    fig, axes = _panels(len(suites), plt)
    for ax, suite in zip(axes, suites, strict=True):
        mine = [r for s, r in rows if s == suite and r.ratio is not None]
        items = [(_label(suite, r), series_of(r), float(r.ratio)) for r in mine]  # type: ignore[arg-type]
        if len({(g, s) for g, s, _ in items}) < len(items):  # the preset alone is ambiguous: use the case
            items = [(r.case, series_of(r), float(r.ratio)) for r in mine]  # type: ignore[arg-type]
        _bars(ax, items, ylabel, unit_line=True)
        ax.set_title(f"suite {suite}", fontsize=9)
    return fig


def _draw_bucket(rows: list[tuple[str, BenchRow]], plt: Any) -> Any:
    kinds = [("throughput", lambda r: r.unit.endswith("/s")), ("memory", lambda r: r.unit in BYTE_UNITS),
             ("other", lambda r: not r.unit.endswith("/s") and r.unit not in BYTE_UNITS)]
    present = [(k, f) for k, f in kinds if any(f(r) for _, r in rows)]
    fig, axes = _panels(len(present), plt)
    for ax, (kind, keep) in zip(axes, present, strict=True):
        lines: dict[str, list[tuple[float, float]]] = {}
        for _, r in rows:
            x = bucket_mib(r)
            if keep(r) and r.ratio is not None and x is not None:
                case = " ".join(_SIZE.sub("", r.case).replace("bucket", "").split())
                lines.setdefault(f"{case}: {r.metric}", []).append((x, r.ratio))
        for name, pts in lines.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xlabel("bucket size (MiB)")
        ax.set_ylabel(f"{kind} ratio vs baseline")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def _draw_mismatch(rows: list[tuple[str, BenchRow]], plt: Any) -> Any:
    metrics = list(dict.fromkeys(r.metric for _, r in rows))
    fig, axes = _panels(len(metrics), plt, height=2.8)
    for ax, metric in zip(axes, metrics, strict=True):
        sel = [(s, r) for s, r in rows if r.metric == metric]
        as_ratio = all(r.ratio is not None for _, r in sel)
        items = [(_label(s, r), str(r.baseline) if as_ratio else s, float(r.ratio if as_ratio else r.value))  # type: ignore[arg-type]
                 for s, r in sel]
        unit = sel[0][1].unit
        _bars(ax, items, "ratio vs baseline" if as_ratio else (unit or "value"), unit_line=as_ratio)
        ax.set_title(metric, fontsize=9)
    return fig


def draw(key: str, rows: list[tuple[str, BenchRow]], machine: Mapping[str, Any], path: Path) -> Path:
    """Draw one figure of FIGURES into a PNG file.

    Args:
        key: the FIGURES key.
        rows: its (suite, row) pairs (from group_rows).
        machine: the machine description (BenchReport.machine), written under the title.
        path: the PNG to write.

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = FIGURES[key]
    if key == "bucket":
        fig = _draw_bucket(rows, plt)
    elif key == "mismatch":
        fig = _draw_mismatch(rows, plt)
    elif key == "memory":
        fig = _draw_bars_by_suite(rows, plt, lambda r: f"{r.metric} vs {r.baseline}", "baseline / ours (x less memory)")
    else:
        fig = _draw_bars_by_suite(rows, plt, lambda r: f"{r.metric} vs {r.baseline}", "ratio vs baseline")
    fig.suptitle(f"{spec.title}\n{machine_line(machine)}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

