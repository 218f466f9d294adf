"""`refit doctor [CONFIG] [KEY=VALUE ...] [--json]`: which parts of the support matrix work here."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from app.cli.plan import add_config_arguments, services_from_args
from app.services.doctor import DoctorReport, diagnose
from app.services.doctor_checks import Status

_STYLE = {Status.OK: "green", Status.WARNING: "yellow", Status.UNAVAILABLE: "dim", Status.ERROR: "bold red"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`refit doctor`'s arguments."""
    add_config_arguments(p)
    p.add_argument("--environment", metavar="JSON", default=None,
                   help="judge the machine described by a saved `refit doctor --json` output instead of this one")


def render(report: DoctorReport, console: Console) -> None:
    """Print the report as a table, the fused-forward decision and a verdict."""
    env = report.environment
    gpus = ", ".join(f"{g.name} ({g.sm})" for g in env.gpus) or "none"
    console.print(f"[bold]refit doctor[/bold]: Python {env.python}, torch {env.version('torch')} "
                  f"(CUDA {env.torch_cuda or 'none'}), GPUs: {gpus}")
    table = Table(title="support matrix on this machine")
    for col in ("area", "part", "status", "what was found", "what to do"):
        table.add_column(col, overflow="fold")
    for c in report.checks:
        status = f"[{_STYLE[c.status]}]{c.status.value}[/]" + (f"\n({c.reason.value})" if c.reason else "")
        table.add_row(c.area, c.name, status, escape(c.detail), escape(c.fix) or "-")
    console.print(table)
    ff = report.fused_forward
    console.print(f"fused forward: requested [bold]{escape(ff.requested)}[/bold] ({ff.source}) -> "
                  f"[bold]{ff.mode or 'none'}[/bold]: {escape(ff.detail)}")
    if report.config_ok is not None:
        console.print("configuration: [green]runs here[/green]" if report.config_ok
                      else "configuration: [bold red]cannot run here[/bold red] (see the error rows)")


def _say(line: str) -> None:
    sys.stderr.write(f"refit doctor: {line}\n")


def run(args: argparse.Namespace) -> int:
    from app.bootstrap import POLICY_ENGINES

    services = services_from_args(args)
    cfg = services.config if args.args else None
    env = services.engines.environment_probe(snapshot_file=args.environment,
                                             notify=None if args.json else _say).snapshot()
    opt_out = False
    if cfg is not None and cfg.rollout.name in POLICY_ENGINES:  # an engine with kernels to choose
        opt_out = services.engines.deep_gemm_opt_out(cfg.rollout.name, env.environ)
    report = diagnose(env, cfg, deep_gemm_opt_out=opt_out)
    if args.json:
        sys.stdout.write(json.dumps(report.to_dict(), indent=2) + "\n")
    else:
        render(report, Console(width=max(Console().width, 120)))
    return 1 if report.config_ok is False else 0
