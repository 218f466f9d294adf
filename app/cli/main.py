"""Entry point of the `refit` command: one sub-module per sub-command, listed here explicitly."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from domain.errors import RefitError

# Sub-command name -> module that defines `add_parser(subparsers)` and `run(args) -> int`.
# Modules are imported lazily so that `refit --help` stays fast and heavy adapters load only
# when their command runs.
COMMANDS: dict[str, str] = {
    "demo": "app.cli.demo",
    "bench": "app.cli.bench",
    "plan": "app.cli.plan",
    "export": "app.cli.export",
    "doctor": "app.cli.doctor",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="refit",
        description="rl-refit: low-precision rollout export, transactional refit, fused log-probs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(importlib.import_module(COMMANDS[args.command]).run(args))
    except RefitError as err:
        # A typed, explained error: print it plainly (no traceback) and exit 2.
        print(f"refit {args.command}: {type(err).__name__}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
