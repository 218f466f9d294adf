"""`refit export` made in the vLLM environment (compressed-tensors 0.17, vLLM's transformers) and in
the project's `.venv` (compressed-tensors 0.20) are the same bytes, file by file: config.json,
the safetensors shards and their index."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (.venv-vllm), which `make test` creates")
pytest.importorskip("transformers", reason="building the tiny HF model needs transformers")

import compressed_tensors

from tests.integration.export_models import save_tiny_model

ROOT = Path(__file__).resolve().parents[2]
MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"

# Cells the engines serve (docs/support-matrix.md): NVFP4 weight-only, MX with MX activations.
PLANS = [
    ("FP8_BLOCK", "NVFP4", "vllm", ["rollout.quantization.moe_activation=none"]),
    ("MXFP8", "MXFP4", "vllm", []),
    ("NVFP4", "FP8_BLOCK", "vllm", ["rollout.quantization.linear_activation=none"]),
    ("FP8_BLOCK", "FP8_BLOCK", "sglang", []),
]


def _ct_version(python: Path | str) -> str:
    out = subprocess.run(
        [str(python), "-c", "import compressed_tensors; print(compressed_tensors.__version__)"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )
    return out.stdout.strip()


@pytest.fixture(scope="module")
def main_python() -> Path:
    if not MAIN_PYTHON.exists():
        pytest.skip(f"{MAIN_PYTHON} is missing: `make setup` creates the project environment")
    if _ct_version(MAIN_PYTHON) == compressed_tensors.__version__:
        pytest.skip(f"both environments hold compressed-tensors {compressed_tensors.__version__}: nothing to compare")
    return MAIN_PYTHON


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("qwen3moe"), moe=True, layers=1)


def _export(python: Path | str, src: Path, out: Path, linear: str, moe: str, engine: str,
            extra: list[str]) -> dict[str, bytes]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [
        str(python), "-m", "app.cli.main", "export", "--model", str(src), "--out", str(out),
        f"rollout.name={engine}", f"rollout.quantization.linear={linear}", f"rollout.quantization.moe={moe}", *extra,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("linear", "moe", "engine", "extra"), PLANS)
def test_exports_are_byte_identical_across_environments(
    main_python: Path, source: Path, tmp_path: Path, linear: str, moe: str, engine: str, extra: list[str]
) -> None:
    here = _export(sys.executable, source, tmp_path / "here", linear, moe, engine, extra)
    there = _export(main_python, source, tmp_path / "there", linear, moe, engine, extra)
    assert sorted(here) == sorted(there)
    assert "config.json" in here and any(name.endswith(".safetensors") for name in here)
    differing = [name for name in here if here[name] != there[name]]
    assert differing == [], f"files that differ between compressed-tensors {compressed_tensors.__version__} and .venv: {differing}"
