"""An export killed at any point, or racing another export to the same destination, never
destroys or fakes a checkpoint.

After every run `--out` is absent, or a complete checkpoint byte for byte equal to an export
that ran undisturbed, or its previous content byte for byte; a shard left in a partial directory
never parses as a checkpoint with missing tensors; and the next export leaves no partial
directory and no lock file behind. Twenty SIGKILLs at lines of the export code drawn by a seeded
RNG, and twenty races of two processes, with and without --force.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors import SafetensorError, safe_open

from app.cli.main import main
from tests.integration import export_child
from tests.integration.export_models import tiny_checkpoint

RUNS = 20
ARGS = ["rollout.quantization.linear=NVFP4", "rollout.quantization.moe=MXFP4", "--shard-size-mb", "0.01", "--json"]


def _tree(path: Path) -> dict[str, bytes] | None:
    """Every file under `path` by relative name, with its bytes; None when `path` is absent."""
    if not path.exists():
        return None
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("src") / "model")


@pytest.fixture(scope="module")
def reference(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("ref") / "out"
    assert main(["export", "--model", str(model), "--out", str(out), *ARGS]) == 0
    tree = _tree(out)
    assert tree is not None and sum(n.endswith(".safetensors") for n in tree) > 2  # several shards
    return tree


@pytest.fixture(scope="module")
def ctx() -> Iterator[object]:
    with export_child.forkserver() as context:
        yield context


def _start(ctx: object, argv: list[str], tmp: Path, kill_at: int = 0, tag: str = "a", start: object = None,
           sig: int = signal.SIGKILL):
    err = tmp / f"stderr-{tag}"
    proc = ctx.Process(target=export_child.run_export,  # type: ignore[attr-defined]
                       args=(argv, kill_at, str(tmp / f"count-{tag}"), str(err), start, sig))
    proc.start()
    return proc, err


def _prepare(out: Path, state: str, previous: dict[str, bytes]) -> dict[str, bytes] | None:
    if state == "empty":
        out.mkdir()
    elif state == "previous":
        out.mkdir()
        for name, data in previous.items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_bytes(data)
    return _tree(out)


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def _check_partial_shards(out: Path, reference: dict[str, bytes]) -> None:
    """A shard left in a partial directory is complete (what the reference has) or unreadable."""
    for partial in out.parent.glob(f".{out.name}.partial-*"):
        for shard in partial.glob("*.safetensors"):
            try:
                with safe_open(str(shard), framework="pt") as f:
                    list(f.keys())
            except SafetensorError:
                continue
            assert shard.read_bytes() == reference.get(shard.name), f"{shard} parses but is not the complete shard"


def test_a_killed_export_leaves_nothing_half_written(model: Path, reference: dict[str, bytes], ctx: object,
                                                     tmp_path: Path) -> None:
    previous = {"config.json": b'{"old": true}\n', "model.safetensors": b"previous bytes", "sub/notes.txt": b"keep"}
    states = ("absent", "empty", "previous")
    lines = {}
    for state in states:  # dry runs: how many lines of the export code each kind of run executes
        out = tmp_path / f"dry-{state}" / "out"
        out.parent.mkdir()
        _prepare(out, state, previous)
        proc, _ = _start(ctx, ["--model", str(model), "--out", str(out), "--force", *ARGS], tmp_path, tag=state)
        proc.join(300)
        assert proc.exitcode == 0
        lines[state] = int((tmp_path / f"count-{state}").read_text())
    rng = random.Random(19)
    killed = 0
    for run in range(RUNS):
        state = states[run % 3]
        out = tmp_path / f"run{run}" / "out"
        out.parent.mkdir()
        before = _prepare(out, state, previous)
        at = rng.randint(1, lines[state])
        argv = ["--model", str(model), "--out", str(out), "--force", *ARGS]
        proc, _ = _start(ctx, argv, tmp_path, kill_at=at, tag=f"run{run}")
        proc.join(300)
        assert proc.exitcode in (-signal.SIGKILL, 0), (run, state, at, proc.exitcode)
        killed += proc.exitcode == -signal.SIGKILL
        after = _tree(out)
        assert after in (None, reference, before), f"run {run} ({state}, killed at line {at}): --out is neither " \
                                                    "absent, nor complete, nor its previous content"
        if state != "absent":
            assert after is not None or before is None, f"run {run}: the previous content was lost"
        _check_partial_shards(out, reference)
        assert main(["export", "--model", str(model), "--out", str(out), "--force", *ARGS]) == 0  # the next export
        assert _tree(out) == reference
        assert _leftovers(out) == [], f"run {run}: {_leftovers(out)} survived the next export"
    assert killed >= RUNS - 2  # the draws fall inside the export, almost all before it ends


def test_two_racing_exports_never_both_write(model: Path, reference: dict[str, bytes], ctx: object,
                                             tmp_path: Path) -> None:
    for run in range(RUNS):
        force = run % 2 == 1
        out = tmp_path / f"race{run}" / "out"
        out.parent.mkdir()
        argv = ["--model", str(model), "--out", str(out), *(["--force"] if force else []), *ARGS]
        start = ctx.Event()  # type: ignore[attr-defined]
        procs = [_start(ctx, argv, tmp_path, tag=f"race{run}-{i}", start=start) for i in range(2)]
        start.set()
        for proc, _ in procs:
            proc.join(300)
        codes = sorted(proc.exitcode for proc, _ in procs)
        errors = " ".join(err.read_text() for _, err in procs)
        # Without --force exactly one may write: the other finds the lock (OutputBusy) or the first one's
        # published checkpoint (OutputNotEmpty). With --force both may succeed, one after the other.
        assert codes in (([0, 0], [0, 2]) if force else ([0, 2],)), (run, force, codes, errors)
        if codes == [0, 2]:
            assert "OutputBusy" in errors or "OutputNotEmpty" in errors, errors
            assert force is False or "OutputBusy" in errors, errors  # with --force only the lock may refuse
        assert _tree(out) == reference, f"race {run}: --out is not one complete checkpoint"
        assert _leftovers(out) == [], f"race {run}: {_leftovers(out)} left behind"


def test_a_terminated_export_cleans_up_after_itself(model: Path, reference: dict[str, bytes], ctx: object,
                                                    tmp_path: Path) -> None:
    out = tmp_path / "dry" / "out"
    out.parent.mkdir()
    proc, _ = _start(ctx, ["--model", str(model), "--out", str(out), *ARGS], tmp_path, tag="dry")
    proc.join(300)
    lines = int((tmp_path / "count-dry").read_text())
    rng = random.Random(143)
    for run in range(3):
        out = tmp_path / f"term{run}" / "out"
        out.parent.mkdir()
        at = rng.randint(1, lines // 2)  # inside the export, before its publish
        proc, err = _start(ctx, ["--model", str(model), "--out", str(out), *ARGS], tmp_path, kill_at=at,
                           tag=f"term{run}", sig=signal.SIGTERM)
        proc.join(300)
        assert proc.exitcode == 128 + signal.SIGTERM, (at, err.read_text())
        assert "stopped by SIGTERM" in err.read_text()
        assert not out.exists() and _leftovers(out) == [], _leftovers(out)  # its own partial and lock are gone
