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


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`refit bench`'s arguments."""
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
                   help="a Hugging Face checkpoint directory (python -m app.bench.fixtures writes one at a real "
                        "model's shapes): with `engine`, the trainer and the vLLM engine on it; with `export`, the "
                        "checkpoint exported; with `refit --delta`, its shapes too")
    p.add_argument("--deployment", choices=("auto", "colocated", "disaggregated"), default=None,
                   help="with `engine`: the engine's deployment shape (default auto: colocated where vLLM imports)")
    p.add_argument("--preset", choices=("BF16", "FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4"), default=None,
                   help="with `engine`: the rollout plan, linear and MoE alike (default FP8_BLOCK; vLLM's CPU build "
                        "serves BF16, FP8_BLOCK, MXFP8; the embedded engine (--device) every one)")
    p.add_argument("--repeat", type=int, default=None, metavar="N", help="with `engine`: measured rounds")
    p.add_argument("--bucket-mb", type=float, default=None, metavar="MIB", help="with `engine`: bucket size")
    p.add_argument("--device", default=None, metavar="DEV",
                   help="cpu, cuda or cuda:N. With `engine`: refits into the embedded engine on DEV (no vLLM), "
                        "against a copy_ of the same bytes on DEV; with `codecs`: where the tensors live")


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


def _engine_or_export(args: argparse.Namespace) -> BenchReport:
    """`refit bench engine` / `export`, on the embedded presets or on `--model DIR`."""
    import attrs

    from app.cli.options import model_or_directory

    model = getattr(args, "model", None)
    if model is not None:
        try:
            model = model_or_directory(())(model)  # a directory with a config.json
        except argparse.ArgumentTypeError as err:
            raise ConfigError("--model", str(err).replace("an embedded model () or ", "")) from None
        from app.bootstrap import bootstrap

        bootstrap().check_checkpoint_config(model)  # before any child or engine builds from it
    engine_only = {"--deployment": getattr(args, "deployment", None), "--preset": getattr(args, "preset", None),
                   "--repeat": getattr(args, "repeat", None), "--bucket-mb": getattr(args, "bucket_mb", None)}
    if args.suite == "export":
        given = [flag for flag, value in engine_only.items() if value is not None]
        if given:
            raise ConfigError(given[0], f"{given[0]} goes with refit bench engine, not export")
        from app.bench.export import run as run_export

        return run_export(quick=args.quick, model_dir=model)
    if getattr(args, "device", None) is not None:
        return _engine_on_device(args, model)
    from app.bench.engine import EngineBenchSettings
    from app.bench.engine import run as run_engine

    settings = EngineBenchSettings.defaults(args.quick)
    changes = {k: v for k, v in {"model": model, "deployment": args.deployment, "preset": args.preset,
                                 "repeat": args.repeat, "bucket_mb": args.bucket_mb}.items() if v is not None}
    if model is not None and args.bucket_mb is None:
        changes["bucket_mb"] = 512.0  # a real-size checkpoint: buckets of real size
    try:
        settings = attrs.evolve(settings, **changes)
    except ValueError as err:
        raise ConfigError("refit bench engine", str(err)) from None
    return run_engine(quick=args.quick, settings=settings)


def _engine_on_device(args: argparse.Namespace, model: object) -> BenchReport:
    """`refit bench engine --device DEV`: the embedded engine on DEV (app.bench.engine_device)."""
    import attrs

    from app.bench.engine_device import DeviceBenchSettings
    from app.bench.engine_device import run as run_device

    if model is not None or args.deployment is not None:
        flag = "--model" if model is not None else "--deployment"
        raise ConfigError(flag, f"{flag} goes with the vLLM engine bench; --device benches the embedded engine")
    settings = DeviceBenchSettings(args.device, repeat=3 if args.quick else 7)
    changes = {k: v for k, v in {"preset": args.preset, "repeat": args.repeat, "bucket_mb": args.bucket_mb}.items()
               if v is not None}
    if not args.quick:
        changes.setdefault("bucket_mb", 4.0)
        changes["model"] = "tiny-moe"
    return run_device(attrs.evolve(settings, **changes))


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
    elif args.suite in ("engine", "export") and not getattr(args, "delta", False):
        report = _engine_or_export(args)
    elif getattr(args, "device", None) is not None:
        if args.suite != "codecs":
            raise ConfigError("--device", "--device goes with the engine and codecs suites")
        from app.bench.codecs import run as run_codecs

        report = run_codecs(quick=args.quick, device=args.device)
    elif getattr(args, "delta", False) or getattr(args, "model", None):
        if args.suite != "refit" or not args.delta:
            raise ConfigError("--delta", "--delta goes with the refit suite (refit bench refit --delta); --model "
                              "with engine, export or refit --delta")
        from app.bench.delta_refit import run as run_delta

        report = run_delta(quick=args.quick, model_dir=args.model)
    else:
        report = importlib.import_module(app.bench.SUITES[args.suite]).run(quick=args.quick)
    if args.json:
        sys.stdout.write(report.to_json() + "\n")
    else:
        render(report, Console())
    return 0
