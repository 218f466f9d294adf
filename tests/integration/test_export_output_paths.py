"""Whatever `--out` names, `refit export` ends in exit 0 or in one line with exit 2, and changes
nothing outside `--out` but the lock and partial directory of a provably dead export to it.

Hypothesis draws `--out` (empty, blank, `.`, `..`, `/`, and paths built from the names in a
sandbox: the model and its parent and children, symlinks to them, a symlink loop, a dangling
link, a user's files named like a lock or a partial, the current and the "home" directory, a
dead export's destination), `--model` (a model, a symlink to it, one named like a partial) and
`--force`, plus one example per reproduction of issue 27, and runs the export in-process (`app.cli.main.main`) on a tiny model. Every entry of
the sandbox is compared before and after.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import attrs
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from adapters.system.ownership import Owner, partial_path
from app.cli.main import main
from app.services import checkpoint_export
from domain.errors import RefitError
from tests.integration.export_models import tiny_checkpoint

EXPORT = ["rollout.quantization.linear=FP8_BLOCK"]
NAMES = ["", ".", "..", "o", "p", "x", "model", "link-model", ".o.partial-m", "sub", "empty", "link-sub", "loop",
         "dangling", ".p.lock", ".o.partial-x", ".o.partial-1", "keep.txt", "dead", "home", "work", "~"]
FIXED = ["", " ", "\t", ".", "..", "/", "~", "{t}", "{t}/o", "{t}/o/", "{t}/model", "{t}/model/..", "{t}/model/o",
         "{t}/link-model", "{t}/link-model/o", "{t}/link-sub/o", "{t}/loop", "{t}/loop/o", "{t}/dangling",
         "{t}/p", "{t}/.p.lock", "{t}/.o.partial-x", "{t}/sub", "{t}/dead", "{t}/new/deep/o", "{t}/home",
         "{t}/home/work/.."]

Entry = tuple[str, bytes | str]


pytestmark = pytest.mark.usefixtures("cli_logging_to_this_tests_stderr")


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("template") / "model", layers=1)


def _sandbox(root: Path, template: Path) -> tuple[Path, Path]:
    """The sandbox's entries; returns the dead export's lock and partial directory."""
    shutil.copytree(template, root / "model")
    shutil.copytree(template, root / ".o.partial-m")  # a model named like a partial of `o`
    (root / "link-model").symlink_to(root / "model")
    (root / "sub").mkdir()
    (root / "sub" / "file.txt").write_text("mine")
    (root / "link-sub").symlink_to(root / "sub")
    (root / "empty").mkdir()
    (root / "loop").symlink_to(root / "loop")
    (root / "dangling").symlink_to(root / "missing")
    (root / ".p.lock").write_text("mine")  # a user's file where the lock of `p` goes
    (root / ".o.partial-x").mkdir()
    (root / ".o.partial-x" / "data").write_text("mine")
    (root / ".o.partial-1").write_text("mine")
    (root / "home" / "work").mkdir(parents=True)
    (root / "home" / "work" / "keep.txt").write_text("mine")
    child = subprocess.Popen(["true"])
    child.wait()
    dead = attrs.evolve(Owner.current(), pid=child.pid)
    lock = root / ".dead.lock"
    lock.write_bytes(dead.to_bytes())
    partial = partial_path(root / "dead", dead.token)
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    return lock, partial


def _entries(root: Path) -> dict[Path, Entry]:
    out: dict[Path, Entry] = {}
    for directory, dirs, files in os.walk(root):  # symlinks are not followed
        for name in dirs + files:
            p = Path(directory) / name
            out[p] = ("link", os.readlink(p)) if p.is_symlink() else ("dir", "") if p.is_dir() else ("file", p.read_bytes())
    return out


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


outs = st.one_of(
    st.sampled_from(FIXED),
    st.builds(lambda absolute, parts: ("{t}/" if absolute else "") + "/".join(parts),
              st.booleans(), st.lists(st.sampled_from(NAMES), min_size=1, max_size=4)),
)


@settings(max_examples=70, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(out=outs, model=st.sampled_from(["model", "link-model", ".o.partial-m"]), force=st.booleans())
@example(out="{t}/o", model=".o.partial-m", force=False)  # the reproductions of issue 27, each
@example(out="", model="model", force=True)
@example(out=".", model="model", force=True)
@example(out="{t}/p", model="model", force=False)
@example(out="{t}/dead", model="model", force=False)
@example(out="{t}/.o.partial-x", model="model", force=True)
@example(out="{t}/link-model/o", model="model", force=True)
@example(out="{t}/loop/o", model="model", force=False)
def test_an_export_changes_nothing_outside_out(out: str, model: str, force: bool, template: Path,
                                               monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(os.path.realpath(tmp))
        dead_lock, dead_partial = _sandbox(root, template)
        cwd, home = root / "home" / "work", root / "home"
        out = out.format(t=root)
        monkeypatch.setattr(checkpoint_export, "_home", lambda: home)
        monkeypatch.chdir(cwd)
        lexical = Path(os.path.normpath(cwd / out))
        if out.strip() and lexical != Path("/") and not _inside(lexical, root):
            return  # a relative path above the sandbox: not this test's to write
        try:
            dest: Path | None = checkpoint_export.destination(out)
        except RefitError:
            dest = None
        before = _entries(root)
        rc = main(["export", "--model", str(root / model), "--out", out, *(["--force"] if force else []), *EXPORT])
        err = capsys.readouterr().err
        event(f"exit {rc}: {err.split(':')[1].strip() if rc else 'exported'}")
        assert rc in (0, 2), (out, model, force, rc, err)
        assert "Traceback" not in err and "internal error" not in err, err
        if rc == 2:
            assert err.count("\n") == 1 and err.startswith("refit export: "), err
        else:
            assert dest is not None and (dest / "config.json").is_file() and (dest / "model.safetensors").is_file()
        after = _entries(root)
        for path in sorted(set(before) | set(after)):
            if before.get(path) == after.get(path):
                continue
            if dest is not None and rc == 0 and _inside(path, dest):
                continue  # the export itself
            if dest is not None and path not in before and after[path] == ("dir", "") and _inside(dest, path):
                continue  # a missing parent of --out, created
            if dest == root / "dead" and (path == dead_lock or _inside(path, dead_partial)):
                assert path not in after  # the dead export's own lock and partial, removed
                continue
            pytest.fail(f"--out {out!r} --model {model} force={force} (exit {rc}) changed {path}: "
                        f"{before.get(path, 'absent')!r:.60} -> {after.get(path, 'absent')!r:.60}")
