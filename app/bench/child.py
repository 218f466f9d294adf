"""A benchmark's measured path runs in a child process (its memory and time are its own); a typed
error the child stops on comes back to the parent as that error, one line, exit status 2
(docs/errors.md#exit-status), instead of an internal error holding the child's traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import domain.errors
from domain.errors import RefitError

ERROR_KEY = "rl_refit_child_error"


def run_reporting(fn: Callable[[], None]) -> None:
    """In the child: run `fn`; on a RefitError, write it as one JSON line on stdout and exit 2."""
    try:
        fn()
    except RefitError as err:
        sys.stdout.write(json.dumps({ERROR_KEY: {"type": type(err).__name__, "message": str(err)}}) + "\n")
        sys.stdout.flush()
        raise SystemExit(2) from None


def typed_error(stdout: str) -> RefitError | None:
    """In the parent: the child's typed error from its stdout (None when it wrote none), of the
    same class where domain.errors has it (RefitError otherwise), with the same message."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            found = json.loads(line)
        except ValueError:
            continue
        if isinstance(found, dict) and isinstance(found.get(ERROR_KEY), dict):
            error = found[ERROR_KEY]
            cls = getattr(domain.errors, str(error.get("type")), RefitError)
            cls = cls if isinstance(cls, type) and issubclass(cls, RefitError) else RefitError
            err = cls.__new__(cls)
            BaseException.__init__(err, str(error.get("message")))  # the constructors differ; the line is the same
            return err
    return None


def python_has(python: str, package: str) -> bool:
    """Whether `package` imports in the interpreter `python` (found, not imported)."""
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({package!r}) is None)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
