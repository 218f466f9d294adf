"""`refit` is quiet by default: third-party notices (torchao's optional extensions failing to load
on a CPU machine, torch's pytree deprecation, Megatron-Core's fallbacks) are shown only with
`--verbose`, and the filters are the CLI's own: set while a command runs, restored after it."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import app.cli.plan
from app.cli.main import QUIET_LOGGERS, main

ROOT = Path(__file__).resolve().parents[2]


def _noisy_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """`refit plan` replaced by a command that emits what torchao and torch emit on import."""
    def run(_args: object) -> int:
        logging.getLogger("torchao").warning("Failed to load _C_mxfp8.so: Could not load this library")
        logging.getLogger("torch.utils._pytree").warning("register_constant() on Enum subclasses is deprecated")
        warnings.warn_explicit("Apex is not installed", UserWarning, "backends.py", 34, module="megatron.core.backends")
        return 0

    monkeypatch.setattr(app.cli.plan, "run", run)


@pytest.mark.parametrize("verbose", [False, True])
def test_third_party_notices_only_with_verbose(verbose: bool, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    _noisy_plan(monkeypatch)
    levels = [logging.getLogger(name).level for name in QUIET_LOGGERS]
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        assert main(["plan", *(["--verbose"] if verbose else [])]) == 0
    logged = [r.getMessage() for r in caplog.records if r.name in ("torchao", "torch.utils._pytree")]
    assert len(logged) == (2 if verbose else 0), logged
    assert len([w for w in shown if "Apex" in str(w.message)]) == (1 if verbose else 0)
    # the levels are the CLI's while a command runs, not the library's: restored afterwards
    assert [logging.getLogger(name).level for name in QUIET_LOGGERS] == levels


def test_verbose_before_the_command_too(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _noisy_plan(monkeypatch)
    with pytest.warns(UserWarning, match="Apex"):
        assert main(["--verbose", "plan"]) == 0
    assert [r for r in caplog.records if r.name == "torchao"]


def test_a_command_that_imports_compressed_tensors_prints_only_its_own_output(tmp_path: Path) -> None:
    # compressed-tensors imports transformers, which imports torchao: its notices came first.
    save_file({"model.layers.0.mlp.down_proj.weight": torch.zeros(128, 128, dtype=torch.bfloat16)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    done = subprocess.run([sys.executable, "-m", "app.cli.main", "plan", "--json", "--model", str(tmp_path),
                           "rollout.quantization.linear=FP8_BLOCK"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
