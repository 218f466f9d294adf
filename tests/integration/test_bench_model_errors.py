"""`refit bench export --model DIR` and `refit bench engine --model DIR` on a hostile checkpoint:
the config.json fields a model is built from are checked before any child process or engine
starts, and a typed error the export bench's child stops on comes back as that error, one line,
exit 2 (before: exit 3, the child's stderr and traceback run together on one line).

The engine bench runs with RL_REFIT_VLLM_PYTHON set to this python, which has no vLLM: a check
that let a checkpoint through would end in "vLLM does not import", never in a real engine."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from adapters.reference.config import MICRO_DENSE
from adapters.reference.hf import write_checkpoint
from adapters.reference.trainer import ReferenceTrainer
from app.bench.child import run_reporting, typed_error
from app.cli.main import main
from domain.errors import ConfigError, NonFiniteTensor, RefitError


@pytest.fixture(autouse=True)
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RL_REFIT_VLLM_PYTHON", sys.executable)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(MICRO_DENSE, ReferenceTrainer.from_seed(MICRO_DENSE, 0).named_weights(),
                            tmp_path_factory.mktemp("m") / "model")


def _edited(model: Path, dest: Path, key: str, value: object) -> Path:
    shutil.copytree(model, dest)
    config = json.loads((dest / "config.json").read_text())
    config[key] = value
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def _one_line(capsys: pytest.CaptureFixture[str], *words: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "internal error" not in err[0] and "Traceback" not in err[0], err
    assert all(w in err[0] for w in words), err


@pytest.mark.parametrize(("key", "value"), [
    ("num_hidden_layers", 10**9), ("vocab_size", 10**12), ("num_attention_heads", None),
    ("rope_parameters", "default"), ("hidden_size", 2**40), ("intermediate_size", [256]),
    # sizes the projections do not have, and fewer layers than the tensors hold (exit 3 after a minute
    # of a real engine, where .venv-vllm existed)
    ("num_attention_heads", 1), ("intermediate_size", 64), ("num_hidden_layers", 1),
])
@pytest.mark.parametrize("suite", ["export", "engine"])
def test_a_config_value_no_model_can_be_built_from_is_one_line(
        model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], suite: str, key: str, value: object) -> None:
    bad = _edited(model, tmp_path / "bad", key, value)
    assert main(["bench", suite, "--model", str(bad)]) == 2  # before: 3
    _one_line(capsys, "CheckpointError", key)


def _tensors_edited(model: Path, dest: Path, edit: Callable[[dict], None]) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, dest)
    held = load_file(str(dest / "model.safetensors"))
    edit(held)
    save_file(held, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("suite", ["export", "engine"])
def test_an_untied_config_without_a_head_is_one_line_before_anything_starts(
        model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], suite: str) -> None:
    assert json.loads((model / "config.json").read_text())["tie_word_embeddings"] is False
    bad = _tensors_edited(model, tmp_path / "headless", lambda held: held.pop("lm_head.weight"))
    assert main(["bench", suite, "--model", str(bad)]) == 2  # before: the engine served a random head
    _one_line(capsys, "CheckpointError", "tie_word_embeddings is false", "no lm_head.weight")


def test_an_fp8_weight_without_its_scale_is_one_typed_line(model: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    def to_fp8(held: dict) -> None:
        held["model.layers.0.mlp.up_proj.weight"] = held["model.layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn)

    bad = _tensors_edited(model, tmp_path / "fp8", to_fp8)
    assert main(["bench", "export", "--model", str(bad)]) == 2
    _one_line(capsys, "refit bench: QuantizedSource", "model.layers.0.mlp.up_proj", "float8_e4m3fn")


def test_the_export_benchs_child_error_comes_back_typed(model: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import load_file, save_file

    bad = shutil.copytree(model, tmp_path / "nan")
    held = load_file(str(bad / "model.safetensors"))
    held["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(held, str(bad / "model.safetensors"), metadata={"format": "pt"})
    assert main(["bench", "export", "--model", str(bad)]) == 2  # before: 3
    _one_line(capsys, "refit bench: NonFiniteTensor", "holds NaN or Inf")


@pytest.mark.parametrize(("raised", "cls"), [
    (lambda: NonFiniteTensor("w", "holds NaN", "fix it"), NonFiniteTensor),
    (lambda: ConfigError("rollout.name", "bad"), ConfigError),
])
def test_a_typed_error_crosses_the_process_boundary_with_its_class_and_line(
        raised: Callable[[], RefitError], cls: type, capsys: pytest.CaptureFixture[str]) -> None:
    err = raised()

    def fail() -> None:
        raise err

    with pytest.raises(SystemExit) as info:
        run_reporting(fail)
    assert info.value.code == 2
    back = typed_error("noise\n" + capsys.readouterr().out)
    assert type(back) is cls and str(back) == str(err)
    assert typed_error("no error here\n") is None
