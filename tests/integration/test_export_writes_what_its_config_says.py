"""The config.json an export writes describes the tensors it writes, and the tensors are what a
loader can take: a re-export of an exported checkpoint decodes its stored weights and says so, a
native layout that is what its quantization_config says passes through, every BF16 module is
ignored and every scaled one claimed, and a tensor that cannot be written honestly (NaN in a
tensor kept BF16, a zero-size NVFP4 weight) stops the export with nothing written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from app.cli.main import main
from domain.quant.codecs import QuantizedWeight, dequantize_weight, quantize_weight
from domain.quant.formats import FP8_BLOCK, MXFP4
from tests.integration.export_models import copy_model, gptq_4bit, gptq_model, model_dir, tiny_checkpoint

EXPORT = ["rollout.quantization.linear=NVFP4", "rollout.quantization.moe=MXFP4"]


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("src") / "model")


# --- a source stored quantized ----------------------------------------------------------------


def test_reexporting_an_mxfp4_export_as_fp8_block_decodes_and_says_so(src: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("compressed_tensors", reason="the check decompresses with compressed-tensors")
    from tests.integration.export_models import decompress_with_model_compressor

    first, second = tmp_path / "mxfp4", tmp_path / "fp8"
    assert main(["export", "--model", str(src), "--out", str(first), "rollout.quantization.linear=MXFP4",
                 "rollout.quantization.moe=MXFP4"]) == 0
    capsys.readouterr()
    assert main(["plan", "--json", "--model", str(first), "rollout.quantization.linear=FP8_BLOCK"]) == 0
    plan = json.loads(capsys.readouterr().out)
    q = "model.layers.0.self_attn.q_proj"
    assert {t["name"]: t["format"] for t in plan["tensors"]}[f"{q}.weight"] == "FP8_BLOCK"  # before: passthrough BF16
    assert plan["plan"]["decoded"] == {"MXFP4": 20}
    assert main(["export", "--model", str(first), "--out", str(second), "--json", "rollout.quantization.linear=FP8_BLOCK"]) == 0
    assert json.loads(capsys.readouterr().out)["decoded"] == {"MXFP4": 20}
    stored, exported = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert not any(n.endswith("weight_packed") for n in exported)
    # The source decoded (compressed-tensors' own decompression), then FP8_BLOCK-encoded, is what was written.
    config = json.loads((first / "config.json").read_text())
    dense = decompress_with_model_compressor(config["quantization_config"], stored)
    expected = quantize_weight(FP8_BLOCK, dense[q].float())
    assert torch.equal(exported[f"{q}.weight"].view(torch.uint8), expected.tensors["weight"].view(torch.uint8))
    assert torch.equal(exported[f"{q}.weight_scale"], expected.tensors["weight_scale"])
    ours = dequantize_weight(QuantizedWeight(MXFP4, {"weight_packed": stored[f"{q}.weight_packed"],
                                                     "weight_scale": stored[f"{q}.weight_scale"]}, (64, 64), torch.float32))
    assert torch.equal(ours, dense[q].float())
    expert = "model.layers.1.mlp.experts.0.up_proj.weight"  # moe is not requested now: decoded, kept BF16
    assert exported[expert].dtype == torch.bfloat16 and torch.equal(exported[expert], dense[expert[:-7]].to(torch.bfloat16))
    # The new config describes these tensors: compressed-tensors loads them strictly, by it.
    qc = json.loads((second / "config.json").read_text())["quantization_config"]
    decompress_with_model_compressor(qc, exported)


def test_reexporting_an_fp8_block_export_works(src: Path, tmp_path: Path) -> None:
    first, second = tmp_path / "fp8", tmp_path / "again"
    assert main(["export", "--model", str(src), "--out", str(first), "rollout.quantization.linear=FP8_BLOCK"]) == 0
    assert main(["export", "--model", str(first), "--out", str(second), "rollout.quantization.linear=FP8_BLOCK"]) == 0
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys()  # before: "tensor names [...weight_scale] appear twice"


def test_a_gptq_checkpoint_that_is_what_its_config_says_passes_through(tmp_path: Path) -> None:
    src = gptq_model(tmp_path, **gptq_4bit())
    assert main(["export", "--model", src, "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["quant_method"] == "gptq"


# --- the config's claims ------------------------------------------------------------------------


def _claimed(qc: dict, module: str) -> bool:
    """compressed-tensors' own reading of a config, written out independently: a module is
    quantized unless an ignore entry matches it (re.match for `re:`, else equality); every group
    here targets `Linear`."""
    import re

    ignored = any(re.match(e[3:], module) if e.startswith("re:") else e == module for e in qc["ignore"])
    return not ignored and any("Linear" in g["targets"] for g in qc["config_groups"].values())


def test_the_written_config_claims_scales_exactly_where_they_were_written(tmp_path: Path) -> None:
    # A 4-D o_proj.weight stays BF16 (no scale) and was missing from the ignore list: the config
    # claimed FP8 for it. Now every BF16 Linear-like module is ignored, every scaled one is not.
    src = model_dir(tmp_path / "m", {
        "model.layers.0.self_attn.o_proj.weight": torch.randn(2, 64, 1, 64).bfloat16(),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(128, 128).bfloat16(),
        "model.layers.0.linear_attn.conv1d.weight": torch.randn(64, 1, 4).bfloat16(),
        "model.layers.0.mlp.down_proj.weight": torch.randn(128, 128).bfloat16(),
        "model.norm.weight": torch.ones(128).bfloat16(),
    })
    out = tmp_path / "out"
    assert main(["export", "--model", str(src), "--out", str(out), "rollout.quantization.linear=FP8_BLOCK",
                 "rollout.quantization.ignore=[mlp.down_proj]"]) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    written = load_file(out / "model.safetensors")
    modules = {n.rsplit(".", 1)[0] for n, t in written.items() if n.endswith(".weight") and t.dim() >= 2}
    assert modules == {f"model.layers.0.{m}" for m in ("self_attn.o_proj", "self_attn.q_proj",
                                                        "linear_attn.conv1d", "mlp.down_proj")}
    for module in modules:
        assert _claimed(qc, module) == (f"{module}.weight_scale" in written), module
    assert "model.layers.0.self_attn.o_proj" in qc["ignore"]


# --- tensors that cannot be written honestly -----------------------------------------------------


def test_a_zero_size_weight_with_nvfp4(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    d = tmp_path / "m"
    d.mkdir()
    save_file({"model.layers.0.mlp.down_proj.weight": torch.zeros(0, 64, dtype=torch.bfloat16)}, d / "model.safetensors")
    (d / "config.json").write_text("{}")
    assert main(["export", "--model", str(d), "--out", str(tmp_path / "o"), "rollout.quantization.linear=NVFP4"]) == 2
    assert "UnsupportedShape" in capsys.readouterr().err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", ["lm_head.weight", "model.norm.weight"])
def test_nan_in_a_tensor_kept_bf16_is_refused(name: str, src: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    def poison(f: Path) -> None:
        t = load_file(f)
        t[name] = t[name].clone()
        t[name].view(-1)[3] = float("nan")
        save_file(t, f)

    m = copy_model(src, tmp_path / "m", model__safetensors=poison)
    assert main(["export", "--model", str(m), "--out", str(tmp_path / "o"), *EXPORT]) == 2
    err = capsys.readouterr().err
    assert "NonFiniteTensor" in err and name in err and not (tmp_path / "o").exists()
