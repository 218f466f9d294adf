"""`refit export` in a child process, for the kill and race tests of test_export_crash.py and the
truncated source of test_export_source_changed.py (which, before, killed its process with SIGBUS).

Children come from a forkserver started with the project's Python (torch and the CLI preloaded,
so each child starts in a fraction of a second; `forkserver()`). A child can be SIGKILLed at its k-th executed line of the
export code (the service, the atomic publish, the lock, the checkpoint writer): the kill test
draws k with a seeded RNG, after a dry run counted the lines.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TRACED = {str(ROOT / p) for p in ("app/services/checkpoint_export.py", "adapters/system/atomic_dir.py",
                                  "adapters/system/ownership.py", "adapters/hf_checkpoint/writer.py")}
PRELOAD = ["torch", "safetensors", "app.cli.main", "app.cli.export", "app.services.checkpoint_export",
           "app.bootstrap", "app.services.planning", "adapters.compressed_tensors.quantization_config"]


@contextlib.contextmanager
def forkserver() -> Iterator[Any]:
    """A forkserver context whose server preloads PRELOAD, for the duration of the block.

    A process has one forkserver, and it preloads only what was asked before it started. When an
    earlier test of the same pytest worker started it (the Megatron worlds do), it preloads none of
    this, and every child imports torch and compressed-tensors itself: seconds each on a loaded
    machine, minutes over the kill and race tests. So the running one is stopped and ours started;
    at the end ours is stopped, and the next user starts a plain one.
    """
    ctx = multiprocessing.get_context("forkserver")
    server: Any = multiprocessing.forkserver._forkserver  # the process's one (no public handle)
    server._stop()
    ctx.set_forkserver_preload(PRELOAD)
    try:
        yield ctx
    finally:
        server._stop()
        ctx.set_forkserver_preload(["__main__"])


def run_export(argv: list[str], kill_at: int, count_file: str | None, err_file: str, start: Any = None,
               sig: int = signal.SIGKILL) -> None:
    """The child: `refit export ARGV`; sends itself `sig` (SIGKILL by default) at its `kill_at`-th
    traced line (0: never).

    Writes the number of traced lines it ran to `count_file` (dry runs), its stderr to
    `err_file`, and exits with main's code.
    """
    import importlib

    from app.cli.main import main

    for module in PRELOAD[2:]:  # imported before tracing (the forkserver may have failed to preload one), so that
        importlib.import_module(module)  # only the export's own run is counted, never a module's import
    count = 0

    def tracer(frame: Any, event: str, _arg: Any) -> Any:
        nonlocal count
        if frame.f_code.co_filename not in TRACED:
            return None
        if event == "line":
            count += 1
            if count == kill_at:
                os.kill(os.getpid(), sig)
        return tracer

    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the result table
    os.dup2(os.open(err_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    if start is not None:
        start.wait()
    sys.settrace(tracer)
    try:
        rc = main(["export", *argv])
    finally:
        sys.settrace(None)
    if count_file is not None:
        Path(count_file).write_text(str(count))
    os._exit(rc)


def run_export_truncating(argv: list[str], source: str, err_file: str) -> None:
    """The child: `refit export ARGV`, truncating `source` to half its size as the first output
    tensor is written (what another process rewriting the model does); exits with main's code."""
    from adapters.hf_checkpoint import writer
    from app.cli.main import main

    real = writer.CheckpointWriter.write

    def write(self: Any, name: str, tensor: Any) -> None:
        if os.path.getsize(source) == size:
            os.truncate(source, size // 2)
        real(self, name, tensor)

    size = os.path.getsize(source)
    writer.CheckpointWriter.write = write  # type: ignore[method-assign]
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.dup2(os.open(err_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    os._exit(main(["export", *argv]))
