"""`refit bench SUITE`: run a benchmark suite and print ratios against same-run baselines."""

from __future__ import annotations

import argparse
import importlib
import sys

from rich.console import Console
from rich.table import Table

import app.bench
from app.bench.report import BenchReport
from domain.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark suite (ratios against baselines in the same run)")
    p.add_argument("suite", choices=sorted({*app.bench.SUITES, "all"}), help="which suite to run (all: every suite, one report)")
    p.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    p.add_argument("--out", metavar="DIR", default="out/bench",
                   help="with `all`: where bench.json, report.md and the PNG figures go (default out/bench)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--delta", action="store_true",
                   help="with `refit`: delta refits (backend layout_delta): bytes, phase times and memory per format")
    p.add_argument("--model", metavar="DIR", default=None,
                   help="with `refit --delta`: also a Qwen3 / Qwen3-MoE checkpoint's shapes (python -m app.bench.fixtures)")


def render(report: BenchReport, console: Console) -> None:
    table = Table(title=f"refit bench {report.suite}")
    for col in ("case", "metric", "value", "baseline", "ratio"):
        table.add_column(col, justify="right" if col in ("value", "ratio") else "left")
    for r in report.rows:
        base = f"{r.baseline} ({r.baseline_value:.4g} {r.unit})" if r.baseline_value is not None else "-"
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else "-"
        table.add_row(r.case, r.metric, f"{r.value:.4g} {r.unit}", base, ratio)
    console.print(table)
    for note in report.notes:
        console.print(f"- {note}")
    m = report.machine
    console.print(
        f"[dim]machine: {m['cpu_count']} cores, {m['memory_gib']} GiB, torch {m['torch']}, "
        f"threads {m['torch_threads']}, cuda {m['cuda']}[/dim]"
    )


def run(args: argparse.Namespace) -> int:
    if args.suite == "all":
        from app.bench.all import cli_run

        return cli_run(args)
    if getattr(args, "delta", False) or getattr(args, "model", None):
        if args.suite != "refit" or not args.delta:
            raise ConfigError("--delta", "--delta (and --model) go with the refit suite: refit bench refit --delta")
        from app.bench.delta_refit import run as run_delta

        report: BenchReport = run_delta(quick=args.quick, model_dir=args.model)
    else:
        report = importlib.import_module(app.bench.SUITES[args.suite]).run(quick=args.quick)
    if args.json:
        sys.stdout.write(report.to_json() + "\n")
    else:
        render(report, Console())
    return 0
