"""Export tiny Qwen3 / Qwen3-MoE checkpoints for every linear/moe combination, then decompress them
with compressed-tensors' ModelCompressor and compare with the codecs (exact) and the originals (bound)."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="building the tiny HF models needs transformers")
pytest.importorskip("compressed_tensors", reason="decompression needs compressed-tensors")

from safetensors.torch import load_file

from adapters.hf_checkpoint.reader import HfCheckpoint
from app.config import build_config
from app.services.checkpoint_export import export_checkpoint
from app.services.planning import make_plan
from domain.quant import naming
from domain.quant.codecs import QuantizedWeight, dequantize_weight, nvfp4_global_scale, quantize_weight
from domain.quant.formats import FORMATS, NVFP4, PrecisionFormat
from tests.integration.export_models import TOKENIZER_FILES, decompress_with_model_compressor, save_tiny_model

DOCS = Path(__file__).resolve().parents[2] / "docs" / "export.md"
PRESETS = [None, "FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4"]
# Largest error of one element, as a share of its block's amax (see docs/export.md).
ERROR_BOUND = {"FP8_BLOCK": 1 / 16, "MXFP8": 1 / 16, "NVFP4": 1 / 4, "MXFP4": 0.34}


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("qwen3"), moe=False)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("qwen3moe"), moe=True, layers=1)


def docs_table() -> dict[str, list[tuple[str, str, str]]]:
    """preset -> [(tensor, dtype, shape expression)] from the table in docs/export.md."""
    rows: dict[str, list[tuple[str, str, str]]] = {}
    for line in DOCS.read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] in FORMATS and FORMATS[cells[0]].is_quantized:
            rows.setdefault(cells[0], []).append((cells[1], cells[2], cells[3]))
    return rows


def _expected_shape(expr: str, n: int, k: int) -> tuple[int, ...]:
    return tuple(int(v) for v in eval(expr, {"ceil": math.ceil, "N": n, "K": k}))


def _block_amax(w: torch.Tensor, fmt: PrecisionFormat) -> torch.Tensor:
    rows, cols = fmt.block_size
    n, k = w.shape
    pad = torch.zeros(-(-n // rows) * rows, -(-k // cols) * cols)
    pad[:n, :k] = w.abs()
    amax = pad.reshape(pad.shape[0] // rows, rows, pad.shape[1] // cols, cols).amax(dim=(1, 3))
    return amax.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:n, :k]


def _export(src: Path, out: Path, **overrides: str | None) -> tuple[dict, dict[str, torch.Tensor], object]:
    # The reference engine serves every plan, per-token NVFP4 included (vLLM serves NVFP4 only weight-only,
    # docs/support-matrix.md); the compressed-tensors export is the same for every engine.
    cfg = build_config({}, [f"rollout.quantization.{k}={'null' if v is None else v}" for k, v in overrides.items()]
                       + ["rollout.name=reference"])
    checkpoint = HfCheckpoint(src)
    report = make_plan(cfg, checkpoint)
    export_checkpoint(checkpoint, out, report)
    config = json.loads((out / "config.json").read_text())
    return config, load_file(out / "model.safetensors"), report


def _check(src: Path, config: dict, exported: dict[str, torch.Tensor], report: object) -> int:
    plan = report.plan  # type: ignore[attr-defined]
    original = load_file(src / "model.safetensors")
    table = docs_table()
    decompressed = decompress_with_model_compressor(config["quantization_config"], exported)
    modules = {naming.module_name(n): n for n in original}
    checked = 0
    for module, name in modules.items():
        w = original[name]
        d = plan.decide(name, tuple(w.shape))
        if not d.is_quantized:
            assert torch.equal(exported[name], w), name  # BF16 passes through bit for bit
            assert module not in decompressed, f"{module} kept BF16 but compressed-tensors quantized it"
            continue
        gs = None
        if d.format.name == NVFP4.name:
            members = naming.group_members(d.group) if d.group else (module,)
            gs = nvfp4_global_scale(*(original[m + ".weight"] for m in members), numerics=plan.numerics)
        ref = quantize_weight(d.format, w, global_scale=gs, numerics=plan.numerics, scale_rule=plan.scale_rule)
        rows = table[d.format.name]
        assert {f"{module}.{t}" for t, _, _ in rows} == {k for k in exported if k.startswith(module + ".")}
        n, k = w.shape
        for tensor, dtype, shape in rows:
            got = exported[f"{module}.{tensor}"]
            assert str(got.dtype).removeprefix("torch.") == dtype and tuple(got.shape) == _expected_shape(shape, n, k)
            assert torch.equal(got.view(torch.uint8), ref.tensors[tensor].view(torch.uint8)), (module, tensor)
        ct = decompressed[module]
        assert torch.equal(ct, dequantize_weight(QuantizedWeight(d.format, ref.tensors, ref.shape, ref.dtype), ct.dtype))
        err = (ct.float() - w.float()).abs()
        assert bool((err <= ERROR_BOUND[d.format.name] * _block_amax(w.float(), d.format) + 1e-30).all()), module
        checked += 1
    return checked


COMBOS = [(lin, moe) for lin, moe in itertools.product(PRESETS, PRESETS) if lin or moe]


@pytest.mark.parametrize(("linear", "moe"), COMBOS, ids=[f"{a}-{b}" for a, b in COMBOS])
def test_moe_export_decompresses_exactly(moe_dir: Path, tmp_path: Path, linear: str | None, moe: str | None) -> None:
    config, exported, report = _export(moe_dir, tmp_path / "out", linear=linear, moe=moe)
    checked = _check(moe_dir, config, exported, report)
    assert checked == (4 if linear else 0) + (12 if moe else 0)
    groups = config["quantization_config"]["config_groups"]
    assert config["quantization_config"]["format"] == ("mixed-precision" if linear and moe and linear != moe else
                                                        next(iter(groups.values()))["format"])


@pytest.mark.parametrize("linear", PRESETS[1:])
def test_dense_export_decompresses_exactly(dense_dir: Path, tmp_path: Path, linear: str) -> None:
    config, exported, report = _export(dense_dir, tmp_path / "out", linear=linear)
    assert _check(dense_dir, config, exported, report) == 14
    out = tmp_path / "out"
    assert all((out / f).is_file() for f in TOKENIZER_FILES)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(exported)


def test_even_scale_rule_matches_compressed_tensors_bytes(moe_dir: Path, tmp_path: Path) -> None:
    config, exported, report = _export(moe_dir, tmp_path / "out", moe="MXFP4", scale_rule="even")
    assert report.plan.scale_rule.value == "even"
    assert _check(moe_dir, config, exported, report) == 12


@pytest.mark.parametrize(("linear", "moe"), [("FP8_BLOCK", "NVFP4"), ("NVFP4", "MXFP8")])
def test_compressed_tensors_numerics_export(moe_dir: Path, tmp_path: Path, linear: str, moe: str) -> None:
    config, exported, report = _export(moe_dir, tmp_path / "out", linear=linear, moe=moe,
                                       numerics="compressed-tensors")
    assert report.plan.numerics.value == "compressed-tensors"
    assert report.plan.scale_rule_for(FORMATS["MXFP8"]).value == "even"
    assert _check(moe_dir, config, exported, report) == 16
    recorded = config["quantization_config"]["rl_refit_numerics"]
    assert recorded["element_rule"] == "compressed-tensors"
    assert {f: e["element_rule"] for f, e in recorded["formats"].items()} == dict.fromkeys({linear, moe}, "compressed-tensors")


def test_docs_table_covers_every_preset() -> None:
    table = docs_table()
    for fmt in FORMATS.values():
        if fmt.is_quantized:
            assert [t for t, _, _ in table[fmt.name]] == list(fmt.tensor_names)
    assert re.search(r"weight_scale_inv", DOCS.read_text())
