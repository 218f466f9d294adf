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
    p.add_argument("--lora", type=int, nargs="?", const=16, default=None, metavar="RANK",
                   help="with `refit`: LoRA refits per actor.lora.sync mode (adapter rank, default 16): bytes, "
                        "seconds and mismatch")
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
    if getattr(args, "lora", None) is not None:
        if args.suite != "refit" or args.delta:
            raise ConfigError("--lora", "--lora goes with the refit suite, without --delta: refit bench refit --lora")
        if args.lora <= 0:
            raise ConfigError("--lora", f"the adapter's rank must be a positive integer, not {args.lora}")
        from app.bench.lora_refit import run as run_lora

        report: BenchReport = run_lora(quick=args.quick, rank=args.lora)
    elif getattr(args, "delta", False) or getattr(args, "model", None):
        if args.suite != "refit" or not args.delta:
            raise ConfigError("--delta", "--delta (and --model) go with the refit suite: refit bench refit --delta")
        from app.bench.delta_refit import run as run_delta

        report = run_delta(quick=args.quick, model_dir=args.model)
    else:
        report = importlib.import_module(app.bench.SUITES[args.suite]).run(quick=args.quick)
    if args.json:
        sys.stdout.write(report.to_json() + "\n")
    else:
        render(report, Console())
    return 0
