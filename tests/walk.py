"""The files of the project a piece of code calls into: a tracer (`sys.setprofile`, every thread
started under it too) that records the file of each Python function entered, module bodies left
out (importing is not walking). docs/architecture.md's walks of one refit state the counts it
measures (tests/unit/test_refit_walk.py, tests/vllm/test_refit_walk.py).

Run in a fresh interpreter, so that no cache an earlier caller warmed hides a call:

    python -m tests.walk demo --steps 1      # prints {"code": ..., "files": [...]} as its last line
    python -m tests.walk --vllm-refit        # one refit into a vLLM server rl-refit starts: the trainer's side
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("domain", "ports", "adapters", "app")


@contextlib.contextmanager
def tracing() -> Iterator[set[str]]:
    """Within the block, the project's files whose functions run (paths relative to the
    checkout, e.g. `app/services/refit.py`), filled as they run."""
    seen: set[str] = set()
    raw: set[str] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_name != "<module>":
            raw.add(frame.f_code.co_filename)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        seen |= project_files(raw)


def project_files(filenames: set[str]) -> set[str]:
    """The project's own files among code filenames, relative to the checkout."""
    out = set()
    for name in filenames:
        try:
            rel = Path(name).resolve().relative_to(ROOT)
        except ValueError:
            continue
        if rel.parts and rel.parts[0] in PACKAGES:
            out.add(rel.as_posix())
    return out


def traced(fn: Callable[[], object]) -> set[str]:
    """The project's files `fn` calls into."""
    with tracing() as seen:
        fn()
    return seen


def vllm_refit() -> tuple[int, set[str]]:
    """One FP8_BLOCK refit of micro-dense into the vLLM server rl-refit starts (disaggregated), traced
    from the configuration to the live weights: the trainer's side (the server's processes are
    vLLM's, not traced here). The server's start and stop are outside the trace."""
    from app.bootstrap import bootstrap
    from app.services.demo_config import engine_config, with_engine_args
    from app.services.engine_demo import EngineDemoSettings
    from domain.quant.plan import QuantizationPlan

    settings = EngineDemoSettings(deployment="disaggregated", plan=QuantizationPlan.from_presets("FP8_BLOCK"),
                                  model="micro-dense")
    services = bootstrap(with_engine_args(engine_config(settings, 0.25), start_timeout_s=900))
    engine = services.rollout_engine()
    try:
        with tracing() as seen:
            report = services.refit_service(engine=engine, trainer=services.trainer_model()).refit()
    finally:
        engine.close()
    return (0 if report.outcome.value == "live" else 1), seen


def stated(test: str) -> tuple[int, dict[str, int]]:
    """What docs/architecture.md states a walk traced by the test file `test` counts: its total
    and its files per package ("calls code in N files of the project (A in app/, B in adapters/,
    ...)")."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    page = " ".join(page.split())  # the sentence may wrap
    found = re.search(rf"`{re.escape(test)}`.*?calls code in (\d+) files of the project \(([^)]*)\)", page)
    assert found, f"docs/architecture.md states no count traced by `{test}`"
    parts = dict(reversed(part.split(" in ")) for part in found.group(2).split(", "))
    return int(found.group(1)), {package.rstrip("/"): int(n) for package, n in parts.items()}


def per_package(files: set[str]) -> dict[str, int]:
    """How many of the files each package has."""
    counts: dict[str, int] = {}
    for f in files:
        counts[f.split("/")[0]] = counts.get(f.split("/")[0], 0) + 1
    return counts


def run(python: str, args: list[str], env: dict[str, str] | None = None, timeout: float = 1200) -> set[str]:
    """The files `python -m tests.walk ARGS` traced (a fresh interpreter in the checkout)."""
    done = subprocess.run([python, "-m", "tests.walk", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, f"tests.walk {' '.join(args)} failed: {done.stderr[-4000:]}"
    result = json.loads(lines[-1])
    assert result["code"] == 0, f"the traced command failed: {done.stderr[-4000:]}"
    return set(result["files"])


def main(argv: list[str]) -> int:
    """Trace `refit ARGV` (its command's module imported first, outside the trace), or, with
    `--vllm-refit`, one refit into a vLLM server (vllm_refit)."""
    if argv == ["--vllm-refit"]:
        code, seen = vllm_refit()
    else:
        import importlib

        from app.cli.main import COMMANDS
        from app.cli.main import main as refit

        importlib.import_module(COMMANDS[argv[0]].module)
        with contextlib.redirect_stdout(io.StringIO()), tracing() as seen:
            code = refit(argv)
    print(json.dumps({"code": code, "files": sorted(seen)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
