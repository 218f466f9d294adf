"""`refit bench imports`: what a command loads before it does its work.

Each case runs in a fresh interpreter (`python -X importtime`), so that nothing an earlier case
imported is counted as free:

- `refit --help`, `refit plan` (the default configuration) and `refit demo` (quick: `--steps 1`)
  run through `app.cli.main.main`; the figures are the modules in `sys.modules` when the command
  ends (the project's own, under domain/, ports/, adapters/, app/, and all of them) and the import
  time, the sum of every import's own time as `-X importtime` reports it (the command's run itself
  is not in it);
- the engine side is what an engine's own processes import of rl-refit, for each engine whose
  plugin names it (adapters.engine_plugin.WorkerSide: its modules, and the engine's modules they
  build on), timed after torch and those are imported. It runs with the engine where an
  interpreter has it (this one, or the engine's server python, docs/engines.md); otherwise with
  a stand-in for every module of the engine's package, which counts rl-refit's own modules and
  the third-party ones they pull (the stand-in costs nothing, so the time is rl-refit's alone).
  The report's notes say which.

Baselines, measured in the same run: for module counts, every module of the project (the size of
the tree); for times, the import time of torch alone in a fresh interpreter (what any command that
touches the domain pays first), and on the engine side the engine's modules rl-refit's build on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import attrs

from adapters.engine_plugin import WorkerSide
from adapters.plugins import PLUGINS
from app.bench.child import python_has
from app.bench.report import BenchReport

PROJECT = ("domain", "ports", "adapters", "app")
ROOT = Path(__file__).resolve().parents[2]  # the checkout whose modules are measured

# In the child: run a command, then print what it loaded as one JSON line (stdout is the command's
# own until then, so it goes to a buffer).
_COMMAND = """
import contextlib, io, json, sys
from app.cli.main import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    code = main(sys.argv[1:])
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""

# A stand-in for every module of the package PACKAGE: any attribute is a class (subscriptable, so
# that `WeightTransferEngine[A, B]` works), and nothing runs.
_STUB = """
import importlib.abc, importlib.machinery, sys, types
class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__class_getitem__": classmethod(lambda cls, item: cls)})
        setattr(self, name, value)
        return value
class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None
    def create_module(self, spec):
        return _Stub(spec.name)
    def exec_module(self, module):
        module.__path__ = []
sys.meta_path.insert(0, _Finder())
"""

_ENGINE = """
import importlib, json, sys, time
import torch
t0 = time.perf_counter()
for name in {base!r}:
    importlib.import_module(name)
base_seconds = time.perf_counter() - t0
before = set(sys.modules)
t0 = time.perf_counter()
for name in {engine!r}:
    importlib.import_module(name)
seconds = time.perf_counter() - t0
print(json.dumps({{"code": 0, "seconds": seconds, "base_seconds": base_seconds, "modules": sorted(sys.modules),
                   "added": sorted(set(sys.modules) - before)}}))
"""


@attrs.frozen
class Loaded:
    """What one fresh interpreter loaded.

    Attributes:
        modules: every module in sys.modules at the end.
        seconds: the import time (the sum of every import's own time; the engine side: the
            wall time of importing its modules).
        code: the command's exit status.
        added: the engine side: the modules its imports added (after torch and the engine's own).
        base_seconds: the engine side: the seconds of importing the engine's modules it builds on.
    """

    modules: tuple[str, ...]
    seconds: float
    code: int = 0
    added: tuple[str, ...] = ()
    base_seconds: float = 0.0

    @property
    def project(self) -> tuple[str, ...]:
        """The project's own modules among them."""
        return tuple(m for m in self.modules if m.split(".")[0] in PROJECT)


def _run(python: str, code: str, args: Sequence[str] = (), *, importtime: bool = True) -> Loaded:
    # the measured checkout first on the child's path (it inherits this process's environment)
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r})\n{code}"
    cmd = [python, *(["-X", "importtime"] if importtime else []), "-c", code, *args]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd[:3])} {' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    found = json.loads(lines[-1])
    seconds = found.get("seconds")
    if seconds is None:  # -X importtime: "import time: self [us] | cumulative | name", one line per module
        seconds = sum(int(line.split("|")[0].split(":")[1]) for line in done.stderr.splitlines()
                      if line.startswith("import time:") and line.split("|")[0].split(":")[1].strip().isdigit()) / 1e6
    return Loaded(tuple(found["modules"]), float(seconds), int(found.get("code", 0)), tuple(found.get("added", ())),
                  float(found.get("base_seconds", 0.0)))


def command(argv: Sequence[str], python: str = sys.executable) -> Loaded:
    """What `refit ARGV` loads, in a fresh interpreter.

    Args:
        argv: the command line after `refit`, e.g. `["plan"]`.
        python: the interpreter.

    Returns:
        Its modules and import time.
    """
    return _run(python, _COMMAND, argv)


def engine_side(package: str, side: WorkerSide, python: str | None = None) -> tuple[Loaded, str]:
    """What an engine's processes import of rl-refit (`side.modules`), in a fresh interpreter.

    Args:
        package: the engine's package (the plugin's `package`).
        side: the plugin's WorkerSide.
        python: an interpreter that has the package; None: a stand-in for every module of it, here.

    Returns:
        The modules and the seconds of importing `side.modules`, and how the engine was provided.
    """
    code = _ENGINE.format(base=side.base, engine=side.modules)
    if python is None:  # the stand-ins are not modules rl-refit adds
        loaded = _run(sys.executable, f"PACKAGE = {package!r}\n" + _STUB + code, importtime=False)
        kept = tuple(m for m in loaded.added if m.split(".")[0] != package)
        return attrs.evolve(loaded, added=kept), f"{package} stubbed (not installed here)"
    version = subprocess.run([python, "-c", f"import {package}; print({package}.__version__)"], capture_output=True,
                             text=True, timeout=600).stdout.strip().splitlines()
    return _run(python, code, importtime=False), f"{package} {version[-1] if version else '?'} ({python})"


def _torch_import(python: str) -> float:
    return _run(python, "import json, sys, torch; print(json.dumps({'modules': sorted(sys.modules)}))").seconds


def _engine_python(name: str, package: str) -> str | None:
    """An interpreter with the engine's package: this one, else the engine's server python (None:
    neither)."""
    if python_has(sys.executable, package):
        return sys.executable
    from app.bootstrap import bootstrap

    python = bootstrap().engines.server_python(name)
    return python if python != sys.executable and python_has(python, package) else None


def run(quick: bool = False) -> BenchReport:
    """Modules and import times of `refit --help`, `refit plan`, `refit demo` and the engine side."""
    report = BenchReport("imports")
    every = sum(1 for package in PROJECT for _ in (ROOT / package).rglob("*.py"))
    torch_s = min(_torch_import(sys.executable) for _ in range(1 if quick else 3))
    cases = {"refit --help": ["--help"], "refit plan": ["plan"],
             "refit demo": ["demo", "--steps", "1"] if quick else ["demo"]}
    for case, argv in cases.items():
        runs = [command(argv) for _ in range(1 if quick or case == "refit demo" else 3)]
        loaded = min(runs, key=lambda r: r.seconds)
        if loaded.code != 0:
            report.notes.append(f"{case} exited with status {loaded.code}")
        report.add(case, "project modules", len(loaded.project), "modules", "every project module", every)
        report.add(case, "modules", len(loaded.modules), "modules")
        report.add(case, "import time", loaded.seconds, "s", "import torch", torch_s)
        report.notes.append(f"{case}: torch {'imported' if 'torch' in loaded.modules else 'not imported'}")
    for plugin in PLUGINS.values():
        side, package = plugin.worker_side, plugin.package
        if side is None or package is None:
            continue
        case = f"engine side ({plugin.name})"
        python = _engine_python(plugin.name, package)
        engine, how = engine_side(package, side, python)
        report.add(case, "project modules", len(engine.project), "modules", "every project module", every)
        report.add(case, "modules rl-refit adds", len(engine.added), "modules")
        if python is None:  # the stand-in costs nothing: no baseline to compare with
            report.add(case, "import time", engine.seconds, "s")
        else:
            report.add(case, "import time", engine.seconds, "s", side.label, engine.base_seconds)
        report.notes.append(f"{case}: {', '.join(side.modules)} after torch and {', '.join(side.base)}; {how}")
    report.notes.append(f"every project module: {every} files under {', '.join(PROJECT)}; import time: the sum of "
                        "each import's own time (-X importtime), best of the runs")
    return report

