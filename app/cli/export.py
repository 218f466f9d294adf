"""`refit export --model DIR --out DIR [CONFIG] [KEY=VALUE ...]`: write a quantized checkpoint directory."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from app.cli import options
from app.cli.plan import add_config_arguments, decoded_note, services_from_args
from app.services.checkpoint_export import ExportResult, export_checkpoint


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`refit export`'s arguments."""
    add_config_arguments(p)
    p.add_argument("--model", metavar="DIR", help="source checkpoint directory (default: model.path)")
    p.add_argument("--out", metavar="DIR", required=True, help="destination directory (must be empty or absent)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out directory")
    p.add_argument("--shard-size-mb", type=options.mebibytes(), default=5 * 1024, metavar="MB",
                   help="safetensors shard size bound in MiB, above 0 (default 5120)")


def _render(result: ExportResult, console: Console) -> None:
    table = Table(title=escape(f"refit export -> {result.out_dir}"))
    table.add_column("")
    table.add_column("value", justify="right")
    rows = [
        ("layout", result.layout),
        ("tensors in / out", f"{result.tensors_in} / {result.tensors_out}"),
        ("MiB in / out", f"{result.bytes_in / 2**20:.1f} / {result.bytes_out / 2**20:.1f}"),
        ("size ratio", f"{result.bytes_out / max(result.bytes_in, 1):.3f}"),
        ("shards", str(result.shards)),
        ("copied files", ", ".join(result.copied_files) or "-"),
        ("time", f"{result.seconds:.2f} s ({result.throughput_mb_s:.1f} MiB/s read)"),
    ]
    if result.decoded:
        rows.insert(1, ("re-quantized", decoded_note(result.decoded)))
    for label, value in rows:
        table.add_row(label, escape(value))
    console.print(table)



def run(args: argparse.Namespace) -> int:
    from app.logging import configure_logging
    from domain.errors import ConfigError

    configure_logging(json=args.json)
    services = services_from_args(args, args.model)
    checkpoint = services.checkpoint()
    report = services.plan_report(checkpoint, purpose="export")
    if checkpoint is None:
        raise ConfigError("model.path", "no model given; pass --model DIR or set model.path")
    quiet = args.json or not sys.stderr.isatty()
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=Console(stderr=True), disable=quiet) as progress:
        task = progress.add_task("exporting", total=checkpoint.total_bytes)
        checkpoint.on_read = lambda n: progress.advance(task, n)
        result = export_checkpoint(checkpoint, args.out, report, force=args.force,
                                   shard_bytes=max(1, int(args.shard_size_mb * 2**20)))
    if args.json:
        sys.stdout.write(json.dumps({**result.to_dict(), "engine_config": report.engine_config}, indent=2) + "\n")
    else:
        _render(result, Console())
    return 0
