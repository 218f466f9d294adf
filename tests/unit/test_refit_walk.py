"""docs/architecture.md's walk of one refit (`refit demo` on the embedded model) states the count a
tracer measures over the real command: the project's files whose functions it calls, per package,
in a fresh interpreter (tests/walk.py)."""

from __future__ import annotations

import sys

from tests.walk import per_package, run, stated


def test_the_embedded_walk_states_the_files_a_traced_refit_calls() -> None:
    files = run(sys.executable, ["demo", "--steps", "1"])
    # the files the walk names are on it: the service, its transaction, the engine, the stream
    for name in ("app/services/refit.py", "app/services/transaction.py", "adapters/reference/engine.py",
                 "domain/quant/stream.py", "domain/refit/buckets.py", "domain/refit/run.py"):
        assert name in files, f"{name} is not on the traced walk: {sorted(files)}"
    total, packages = stated("tests/unit/test_refit_walk.py")
    assert (len(files), per_package(files)) == (total, packages), (
        f"docs/architecture.md states {total} files {packages}; the tracer counts {len(files)} "
        f"{per_package(files)}: {sorted(files)}")
