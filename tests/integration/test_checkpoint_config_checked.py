"""`refit demo --model DIR` on a hostile checkpoint: its config.json is checked field by field
against the tensors present before anything is built, and the demo refuses what `refit export`
refuses. Each case was an internal error (exit 3), a hang, or a run on weights silently converted;
now each is one CheckpointError line naming the key or the tensor, exit 2.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from adapters.reference.config import MICRO_DENSE, MICRO_MOE
from adapters.reference.hf import write_checkpoint
from adapters.reference.trainer import ReferenceTrainer
from app.cli.main import main


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: write_checkpoint(cfg, ReferenceTrainer.from_seed(cfg, 0).named_weights(), root / name)
            for name, cfg in (("dense", MICRO_DENSE), ("moe", MICRO_MOE))}


def _variant(src: Path, dest: Path, *, config: Callable[[dict[str, Any]], None] | None = None,
             tensors: Callable[[dict[str, torch.Tensor]], None] | None = None, raw: str | None = None) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    if tensors is not None:
        held = load_file(str(dest / "model.safetensors"))
        tensors(held)
        save_file(held, str(dest / "model.safetensors"), metadata={"format": "pt"})
    if config is not None or raw is not None:
        data = json.loads((dest / "config.json").read_text())
        if config is not None:
            config(data)
        text = json.dumps(data)
        if raw is not None:  # a JSON literal Python's json cannot write (1e309)
            key, literal = raw.split("=", 1)
            text = text.replace(f'"{key}": {json.dumps(data[key])}', f'"{key}": {literal}')
        (dest / "config.json").write_text(text)
    return dest


def _demo(model: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["demo", "--model", str(model), "--steps", "1", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    return code, "\n".join(err)


def _set(key: str, value: object) -> Callable[[dict[str, Any]], None]:
    return lambda c: c.__setitem__(key, value)


def _drop_then_set(drop: str, key: str, value: object) -> Callable[[dict[str, Any]], None]:
    def edit(c: dict[str, Any]) -> None:
        c.pop(drop, None)
        c[key] = value
    return edit


# (model, edit, the key the one line must name); the first 13 were exit 3 on main before
MALFORMED: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("dense", _set("vocab_size", None), "vocab_size"),
    ("dense", _set("num_attention_heads", None), "num_attention_heads"),
    ("moe", _set("decoder_sparse_step", None), "decoder_sparse_step"),
    ("moe", _set("num_experts_per_tok", None), "num_experts_per_tok"),
    ("dense", _set("num_attention_heads", "four"), "num_attention_heads"),
    ("dense", _drop_then_set("head_dim", "num_attention_heads", 0), "num_attention_heads"),
    ("dense", _set("intermediate_size", [256]), "intermediate_size"),
    ("moe", _set("mlp_only_layers", 5), "mlp_only_layers"),
    ("dense", _set("rope_parameters", "default"), "rope_parameters"),
    ("dense", _set("rope_parameters", [1]), "rope_parameters"),
    ("dense", _set("vocab_size", 10**12), "vocab_size"),
    ("dense", _set("hidden_size", 2**40), "hidden_size"),
    # silent coercions before: a float or a string where an integer must be
    ("dense", _set("hidden_size", 128.5), "hidden_size"),
    ("dense", _set("vocab_size", 512.9), "vocab_size"),
    ("dense", _set("hidden_size", "128"), "hidden_size"),
    ("dense", _set("num_hidden_layers", True), "num_hidden_layers"),
    ("moe", _set("num_experts_per_tok", 99), "num_experts_per_tok"),
    ("moe", _set("mlp_only_layers", [7]), "mlp_only_layers"),
    ("dense", _set("rms_norm_eps", -1), "rms_norm_eps"),
    ("dense", _set("attention_bias", "no"), "attention_bias"),
    ("dense", _set("tie_word_embeddings", "yes"), "tie_word_embeddings"),
    ("dense", _set("num_key_value_heads", 3), "num_key_value_heads"),
    ("dense", _set("vocab_size", 1024), "vocab_size"),  # the embeddings hold 512 rows
]


@pytest.mark.parametrize(("model", "edit", "key"), MALFORMED, ids=[f"{m}-{k}-{i}" for i, (m, _, k) in enumerate(MALFORMED)])
def test_a_malformed_config_value_is_one_checkpoint_error_naming_the_key(
        models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str,
        edit: Callable[[dict[str, Any]], None], key: str) -> None:
    code, err = _demo(_variant(models[model], tmp_path / "m", config=edit), capsys)
    assert code == 2, err  # before: 3 (internal error) for the first 13, 0 for the coercions
    assert len(err.splitlines()) == 1 and "CheckpointError" in err and key in err, err


def test_an_infinite_vocab_size_is_refused(models: dict[str, Path], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _demo(_variant(models["dense"], tmp_path / "m", raw="vocab_size=1e309"), capsys)
    assert code == 2 and "CheckpointError" in err and "vocab_size" in err, err  # before: exit 3


@pytest.mark.parametrize("layers", [100_000, 10**9])
def test_a_layer_count_beyond_the_tensors_is_refused_at_once(models: dict[str, Path], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str], layers: int) -> None:
    start = time.monotonic()
    code, err = _demo(_variant(models["dense"], tmp_path / "m", config=_set("num_hidden_layers", layers)), capsys)
    assert code == 2 and "num_hidden_layers" in err and "2 layers" in err, err  # before: built a model for ever
    assert time.monotonic() - start < 60  # a generous ceiling: the refusal reads headers only


def _retype(name: str, dtype: torch.dtype) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda held: held.__setitem__(name, held[name].to(dtype))


UP = "model.layers.0.mlp.up_proj.weight"


@pytest.mark.parametrize(("edit", "words"), [
    (_retype(UP, torch.int32), ["CheckpointError", UP, "int32"]),
    (_retype(UP, torch.float8_e4m3fn), ["QuantizedSource", "model.layers.0.mlp.up_proj", "float8_e4m3fn"]),
    (lambda held: held.pop("lm_head.weight"), ["CheckpointError", "lm_head.weight", "tie_word_embeddings"]),
])
def test_the_demo_refuses_what_export_refuses(models: dict[str, Path], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str],
                                              edit: Callable[[dict[str, torch.Tensor]], None], words: list[str]) -> None:
    model = _variant(models["dense"], tmp_path / "m", tensors=edit)
    code, err = _demo(model, capsys)
    assert code == 2 and len(err.splitlines()) == 1, err  # before: 0, on converted weights or a copied head
    assert all(w in err for w in words), err


def test_a_tied_checkpoint_without_a_head_still_runs(models: dict[str, Path], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    model = _variant(models["dense"], tmp_path / "m", tensors=lambda held: held.pop("lm_head.weight"),
                     config=_set("tie_word_embeddings", True))
    code, err = _demo(model, capsys, "--steps", "0")
    assert code == 0, err


def _poison(name: str, value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(held: dict[str, torch.Tensor]) -> None:
        t = held[name].clone()
        t.view(-1)[0] = value
        held[name] = t
    return edit


@pytest.mark.parametrize(("name", "value"), [(UP, float("nan")), ("model.embed_tokens.weight", float("inf"))])
def test_a_demo_where_no_refit_went_live_exits_1_and_measures_nothing(
        models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, value: float) -> None:
    model = _variant(models["dense"], tmp_path / "m", tensors=_poison(name, value))
    capsys.readouterr()
    code = main(["demo", "--model", str(model), "--steps", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1  # before: 0
    assert all(s["refit"]["outcome"] != "live" for s in out["steps"])
    for row in out["summary"]:  # before: 0.0, what a perfect BF16 refit scores
        assert row["refits_ok"] == 0 and row["k3_kl"] is None and row["mean_abs_logp_diff"] is None
    assert any("went live" in n for n in out["notes"])
    code = main(["demo", "--model", str(model), "--steps", "1"])
    table = capsys.readouterr().out
    assert code == 1 and "0.000e+00" not in table
    rows = [line for line in table.splitlines() if line.startswith("│ BF16")]
    assert rows and all(cell.strip() == "-" for cell in rows[-1].split("│")[2:8]), rows
