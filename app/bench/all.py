"""`refit bench all [--quick] [--out DIR]`: every registered suite, one JSON file, one Markdown report.

Runs each suite of `app.bench.SUITES` (except `all` itself) in this process, one after the
other, and writes into DIR (default `out/bench/`):

- `bench.json`: the machine, and per suite its status (`ok`, `skipped` when an optional package
  is missing, `error`), seconds, rows and notes;
- `report.md`: the machine, a summary per suite, each suite's table of ratios against the
  baselines measured in the same run, and the figures;
- `bench-<figure>.png`: the figures of `app.bench.figures`.

A suite that fails does not stop the others; the command then exits 1.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import structlog

from adapters.hf_checkpoint.writer import writing
from app.bench import figures
from app.bench.report import BenchReport, machine_description

log = structlog.get_logger()

DEFAULT_OUT = Path("out/bench")
JSON_NAME = "bench.json"
REPORT_NAME = "report.md"
PROJECT_PACKAGES = ("domain", "ports", "adapters", "app")
QUICK_BUDGET_S = 120.0  # `--quick` of all suites together should stay below this


@attrs.define
class SuiteResult:
    """One suite's outcome: its report, or why there is none."""

    name: str
    status: str  # ok, skipped, error
    seconds: float
    report: BenchReport | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"status": self.status, "seconds": round(self.seconds, 3), "error": self.error}
        if self.report is not None:
            d.update(rows=[r.to_dict() for r in self.report.rows], notes=self.report.notes)
        return d


@attrs.define
class AllResult:
    """What `refit bench all` measured and wrote."""

    quick: bool
    machine: dict[str, Any]
    suites: list[SuiteResult]
    seconds: float
    figures: dict[str, Path] = attrs.field(factory=dict)
    out_dir: Path | None = None

    @property
    def ok(self) -> bool:
        return all(s.status != "error" for s in self.suites)

    def to_dict(self) -> dict[str, Any]:
        return {
            "quick": self.quick,
            "seconds": round(self.seconds, 3),
            "machine": self.machine,
            "suites": {s.name: s.to_dict() for s in self.suites},
            "figures": {k: {"file": p.name, "title": figures.FIGURES[k].title} for k, p in self.figures.items()},
        }


def suite_names(suites: Mapping[str, object]) -> list[str]:
    """The suites `all` runs: every registered one but `all`, in registration order."""
    return [name for name in suites if name != "all"]


def run_suite(name: str, module: str | Callable[[bool], BenchReport], quick: bool) -> SuiteResult:
    """Run one suite; a missing optional package makes it `skipped`, any other failure `error`."""
    bound = log.bind(suite=name, quick=quick)
    t0 = time.perf_counter()
    try:
        run = importlib.import_module(module).run if isinstance(module, str) else module
        report = run(quick)
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] in PROJECT_PACKAGES:  # our own import is broken: a bug
            bound.error("bench_suite_failed", error=repr(err))
            return SuiteResult(name, "error", time.perf_counter() - t0, error=f"{type(err).__name__}: {err}")
        bound.warning("bench_suite_skipped", reason=str(err))
        return SuiteResult(name, "skipped", time.perf_counter() - t0, error=f"{type(err).__name__}: {err}")
    except Exception as err:  # a broken suite must not hide the others' results
        bound.error("bench_suite_failed", error=repr(err))
        return SuiteResult(name, "error", time.perf_counter() - t0, error=f"{type(err).__name__}: {err}")
    seconds = time.perf_counter() - t0
    bound.info("bench_suite_done", seconds=round(seconds, 2), rows=len(report.rows))
    return SuiteResult(name, "ok", seconds, report=report)


def run_all(
    suites: Mapping[str, str | Callable[[bool], BenchReport]],
    *,
    quick: bool = False,
    out_dir: Path | None = DEFAULT_OUT,
    on_suite: Callable[[SuiteResult], None] | None = None,
) -> AllResult:
    """Run every suite and write bench.json, report.md and the PNG figures.

    Args:
        suites: suite name -> module name (as in `app.bench.SUITES`) or a `run(quick)` callable.
        quick: pass `quick=True` to every suite.
        out_dir: where to write; None writes nothing (the result is still complete).
        on_suite: called after each suite (progress display).

    Returns:
        The AllResult, with the paths of the figures written.
    """
    t0 = time.perf_counter()
    load_before = _load_average()
    results = []
    for name in suite_names(suites):
        res = run_suite(name, suites[name], quick)
        results.append(res)
        if on_suite is not None:
            on_suite(res)
    machine = {**machine_description(), "load_average_before": load_before, "load_average_after": _load_average()}
    result = AllResult(quick, machine, results, time.perf_counter() - t0)
    if out_dir is not None:
        write(result, Path(out_dir))
    return result


def _load_average() -> float | None:
    """The 1-minute load average (other work on the machine skews every timing), None if unknown."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def check_writable(out_dir: Path) -> None:
    """Create `out_dir` if needed and write (and remove) a probe file in it.

    Args:
        out_dir: where the report will go.

    Returns:
        None. Raises OutputNotWritable naming the directory, the system's reason and the fix.
    """
    with writing(out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".refit-bench-probe-"):
            pass


def write(result: AllResult, out_dir: Path) -> None:
    """Write the JSON file, the figures and the Markdown report into `out_dir` (OutputNotWritable
    when it cannot be written)."""
    with writing(out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
        rows = {s.name: s.report.rows for s in result.suites if s.report is not None}
        for key, pairs in figures.group_rows(rows).items():
            result.figures[key] = figures.draw(key, pairs, result.machine, out_dir / f"bench-{key}.png")
        result.out_dir = out_dir
        (out_dir / JSON_NAME).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
        (out_dir / REPORT_NAME).write_text(markdown(result))


def _fmt(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    return f"{v:.4g} {unit}".strip()


def markdown(result: AllResult) -> str:
    """The Markdown report: machine, summary, one table per suite, the figures with captions."""
    mode = "quick" if result.quick else "full"
    lines = [
        "# rl-refit benchmark report", "",
        f"`refit bench all{' --quick' if result.quick else ''}` ({mode} sizes), {result.seconds:.1f} s in all.",
        f"Machine: {figures.machine_line(result.machine)}; {result.machine.get('platform')}.",
        f"Load average (1 min) before and after: {result.machine.get('load_average_before')} and "
        f"{result.machine.get('load_average_after')}; timings are only comparable on an otherwise idle machine.", "",
        "Every ratio is against a baseline measured in the same run: for throughputs ours / baseline, "
        "for times and bytes baseline / ours, so above 1 is better.", "",
        "| suite | status | seconds | rows |", "|---|---|---|---|",
    ]
    for s in result.suites:
        rows = len(s.report.rows) if s.report else 0
        status = s.status if not s.error else f"{s.status}: {s.error}"
        lines.append(f"| {s.name} | {status.replace('|', '/')} | {s.seconds:.1f} | {rows} |")
    for s in result.suites:
        if s.report is None:
            continue
        lines += ["", f"## {s.name}", "", "| case | metric | value | baseline | ratio |", "|---|---|---|---|---|"]
        for r in s.report.rows:
            base = f"{r.baseline} ({_fmt(r.baseline_value, r.unit)})" if r.baseline else "-"
            ratio = f"{r.ratio:.2f}x" if r.ratio is not None else "-"
            cells = (r.case, r.metric, _fmt(r.value, r.unit), base, ratio)
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines += [""] + [f"- {n}" for n in s.report.notes]
    if result.figures:
        lines += ["", "## Figures"]
    for key, path in result.figures.items():
        spec = figures.FIGURES[key]
        lines += ["", f"### {spec.title}", "", f"![{spec.title}]({path.name})", "", f"{spec.description}."]
    return "\n".join(lines) + "\n"


def cli_run(args: argparse.Namespace) -> int:
    """`refit bench all`: run, write, print a summary (or the JSON with --json); exit 1 on a failed suite."""
    from rich.console import Console

    from app.bench import SUITES
    from app.logging import configure_logging

    configure_logging(json=args.json, level=logging.WARNING)  # suites log every refit at info; keep it readable
    err = Console(stderr=True)

    def progress(res: SuiteResult) -> None:
        err.print(f"bench {res.name}: {res.status} in {res.seconds:.1f} s" + (f" ({res.error})" if res.error else ""))

    check_writable(Path(args.out))  # before the suites: minutes of results with nowhere to go are lost
    result = run_all(SUITES, quick=args.quick, out_dir=Path(args.out), on_suite=progress)
    if args.json:
        sys.stdout.write(json.dumps(result.to_dict(), indent=2) + "\n")
    else:
        out, where = Console(), Path(args.out)
        out.print(f"wrote {where / JSON_NAME}, {where / REPORT_NAME} and "
                  f"{len(result.figures)} figures in {result.seconds:.1f} s")
        if args.quick and result.seconds > QUICK_BUDGET_S:
            out.print(f"[yellow]--quick took {result.seconds:.0f} s, over its {QUICK_BUDGET_S:.0f} s budget[/yellow]")
    return 0 if result.ok else 1
