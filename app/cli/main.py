"""Entry point of the `refit` command: one sub-module per sub-command, listed here explicitly.

A command's module is imported only when that command runs (or asks for its `--help`): `refit
--help` lists every command's name and help from the table below without importing any of them,
and `refit plan` imports what planning needs, never the demos, the benchmarks or an engine.

Exit status (docs/errors.md lists every error with its code):

| code | meaning |
|---|---|
| 0 | success |
| 1 | the command ran and reports a failure of its own (documented per command) |
| 2 | a typed rl-refit error, a missing optional package, or a bad command line: one line on stderr |
| 3 | an internal error (a bug): one line on stderr; `--debug` shows the traceback |
| 128 + N | stopped by signal N (130 for Ctrl-C, 143 for SIGTERM), after cleaning up |
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
import traceback
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple, NoReturn

from domain.errors import RefitError


class Command(NamedTuple):
    """One sub-command: the module that defines `add_arguments(parser)` and `run(args) -> int`,
    and the one line `refit --help` shows for it."""

    module: str
    help: str


# Sub-command name -> its module and help. A module is imported only when its command is chosen,
# so that `refit --help` stays fast and heavy adapters load only when their command runs.
COMMANDS: dict[str, Command] = {
    "demo": Command("app.cli.demo", "the main job: refit round trips on the embedded default model"),
    "bench": Command("app.cli.bench", "run a benchmark suite (ratios against baselines in the same run)"),
    "plan": Command("app.cli.plan", "validate a rollout quantization configuration and print every decision"),
    "export": Command("app.cli.export", "HF checkpoint directory -> quantized compressed-tensors checkpoint directory"),
    "doctor": Command("app.cli.doctor", "inspect this machine (and a configuration): what works here and why not"),
    "mismatch": Command("app.cli.mismatch", "per preset: the trainer's log-probs against the rollout's, with verl's "
                        "metric names"),
}

EXIT_OK, EXIT_FAILED, EXIT_ERROR, EXIT_INTERNAL = 0, 1, 2, 3

# Third-party notices that say nothing to a user of `refit`, shown only with --verbose: torchao's
# optional CUDA extensions failing to load on a CPU machine, torch's deprecation of a pytree call
# torchao makes, the fallbacks Megatron-Core announces without Transformer Engine or Apex.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree", "transformers", "compressed_tensors", "megatron", "modelopt")
QUIET_WARNINGS_FROM = r"(torch|torchao|transformers|compressed_tensors|megatron|modelopt|pydantic|triton)(\.|$)"
_SIGNALS = ("SIGTERM", "SIGHUP")  # besides SIGINT, which Python already raises as KeyboardInterrupt


class Terminated(BaseException):
    """A termination signal, raised in the main thread so that every `finally` (an export's
    cleanup of its temporary directory) runs before the process exits."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors on one line (like every other error) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(commands: Iterable[str] = COMMANDS) -> argparse.ArgumentParser:
    """The `refit` parser.

    Args:
        commands: the commands whose arguments the parser knows (their modules are imported);
            every other command is listed by name and help only (default: every command).
    """
    parser = _Parser(
        prog="refit",
        description="rl-refit: low-precision rollout export, transactional refit, fused log-probs.",
    )
    debug_help = "on an error, also print its traceback"
    verbose_help = "also show the notices of third-party packages (torch, torchao, transformers, ...)"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    parser.add_argument("--verbose", action="store_true", help=verbose_help)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    built = set(commands)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help)
        if name in built:
            importlib.import_module(command.module).add_arguments(p)
    for each in sub.choices.values():  # `refit export ... --debug` as well as `refit --debug export`
        each.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
        if "--verbose" not in each._option_string_actions:  # a command may say more about it (demo)
            each.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS, help=verbose_help)
    return parser


def one_line(text: str) -> str:
    """A message on one line: its lines joined with '; '."""
    return "; ".join(line.strip() for line in text.strip().splitlines() if line.strip())


@contextlib.contextmanager
def _termination_raises() -> Iterator[None]:
    """SIGTERM and SIGHUP raise Terminated in the main thread while the command runs."""
    def handler(signum: int, _frame: object) -> None:
        raise Terminated(signum)

    saved = {}
    with contextlib.suppress(ValueError):  # not the main thread: leave the handlers alone
        for name in _SIGNALS:
            if hasattr(signal, name):
                signum = getattr(signal, name)
                saved[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, previous in saved.items():
            signal.signal(signum, previous)


@contextlib.contextmanager
def third_party_notices(*, shown: bool) -> Iterator[None]:
    """While the command runs, hide (unless `shown`) the warnings and log records of the
    QUIET_LOGGERS packages below ERROR; the filters and levels are restored afterwards.

    Args:
        shown: --verbose: leave every notice as the packages emit it.
    """
    loggers = [logging.getLogger(name) for name in QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        if not shown:
            warnings.filterwarnings("ignore", module=QUIET_WARNINGS_FROM)
            for logger in loggers:
                logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)


def chosen_command(argv: Sequence[str]) -> tuple[str, ...]:
    """The command a command line runs, as build_parser's `commands` (none: `refit --help`, or no
    command, which the parser then reports). The options before it take no value."""
    first = next((arg for arg in argv if not arg.startswith("-")), None)
    return (first,) if first in COMMANDS else ()


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(chosen_command(argv))
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help (0) or a bad command line (2, its line already printed)
        return done.code if isinstance(done.code, int) else EXIT_ERROR
    where = f"refit {args.command}"
    try:
        with _termination_raises(), third_party_notices(shown=args.verbose):
            return int(importlib.import_module(COMMANDS[args.command].module).run(args))
    except RefitError as err:
        # A typed, explained error: print it plainly and exit 2.
        return _report(args, f"{where}: {type(err).__name__}: {one_line(str(err))}", EXIT_ERROR)
    except ModuleNotFoundError as err:  # an optional package is missing; the message names it
        return _report(args, f"{where}: ModuleNotFoundError: {one_line(str(err))}", EXIT_ERROR)
    except KeyboardInterrupt:
        return _report(args, f"{where}: interrupted", 128 + signal.SIGINT)
    except Terminated as err:
        return _report(args, f"{where}: stopped by {err}", 128 + err.signum)
    except BrokenPipeError:  # `refit ... --json | head`: the reader left; say nothing more
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    except Exception as err:
        hint = "" if args.debug else "; rerun with --debug for the traceback"
        line = (f"{where}: internal error: {type(err).__name__}: {one_line(str(err)) or '(no message)'}"
                f" (a bug in rl-refit: please report it{hint})")
        return _report(args, line, EXIT_INTERNAL)


def _report(args: argparse.Namespace, line: str, code: int) -> int:
    if args.debug:
        traceback.print_exc()
    # what the user typed is echoed; a lone surrogate in it must not fail the report itself
    print(line.encode("utf-8", "backslashreplace").decode("utf-8"), file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
