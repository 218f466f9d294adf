"""A user's compressed-tensors config reaches the engine as written: kv_cache_scheme, ignore list
and groups with their own targets. The reference for which module gets which scheme is
compressed-tensors' own `apply_quantization_config` on the transformers model; the exported
tensors are loaded strictly into the module tree compressed-tensors builds from the same config."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="building the tiny HF models needs transformers")
pytest.importorskip("compressed_tensors", reason="the reference matching is compressed-tensors' own")

from safetensors.torch import load_file

from adapters.hf_checkpoint.reader import HfCheckpoint
from app.cli.main import main
from app.config import build_config
from app.services.checkpoint_export import export_checkpoint
from app.services.planning import make_plan
from domain.errors import ConfigNotHonoured
from tests.integration.export_models import decompress_with_model_compressor, save_tiny_model

FP8_BLOCK_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                     "block_structure": [128, 128], "dynamic": False}
FP8_GROUP_INPUTS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": 128,
                    "dynamic": True}
# Attention only, with an exact-name ignore entry and a plain "o_proj" entry (which compressed-
# tensors reads as an exact name: it matches nothing), and an FP8 KV cache.
USER_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "attention": {"targets": [r"re:.*self_attn\.(q|k|v|o)_proj$"], "weights": FP8_BLOCK_WEIGHTS,
                      "input_activations": FP8_GROUP_INPUTS, "format": "float-quantized"},
    },
    "ignore": ["lm_head", "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
               "model.layers.1.self_attn.v_proj", "o_proj"],
    "kv_cache_scheme": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False},
}


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("qwen3"), moe=False)


def _file(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "quantization_config.json"
    path.write_text(json.dumps(config))
    return path


def _plan(dense_dir: Path, config_file: Path, *extra: str):  # type: ignore[no-untyped-def]
    cfg = build_config({}, ["rollout.name=vllm", f"rollout.quantization.config_file={config_file}", *extra])
    return make_plan(cfg, HfCheckpoint(dense_dir))


def _compressed_tensors_schemes(dense_dir: Path, config: dict) -> dict[str, str]:
    """module -> "FP8_BLOCK" / "BF16", as compressed-tensors applies the config to the HF model."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.bfloat16)
    qc = QuantizationConfig.model_validate({k: v for k, v in config.items() if k != "kv_cache_scheme"})
    apply_quantization_config(model, qc)
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            scheme = getattr(module, "quantization_scheme", None)
            out[name] = "BF16" if scheme is None else {"block": "FP8_BLOCK"}[str(getattr(scheme.weights.strategy, "value", scheme.weights.strategy))]
    return out


def test_the_engine_gets_the_config_as_written(dense_dir: Path, tmp_path: Path) -> None:
    report = _plan(dense_dir, _file(tmp_path, USER_CONFIG))
    assert report.engine_config == USER_CONFIG  # kv_cache_scheme, ignore list and the group's targets kept
    assert report.resolution.as_written
    as_written = next(o for o in report.resolution.outcomes if o.rule == "ConfigAsWritten")
    assert "as written" in as_written.outcome and "kv_cache_scheme kept" in as_written.outcome


def test_every_tensor_is_exported_as_compressed_tensors_assigns_it(dense_dir: Path, tmp_path: Path) -> None:
    report = _plan(dense_dir, _file(tmp_path, USER_CONFIG))
    reference = _compressed_tensors_schemes(dense_dir, USER_CONFIG)
    ours = {d.name.removesuffix(".weight"): d.format.name for d in report.decisions if d.name.endswith(".weight")}
    assert {m: ours[m] for m in reference} == reference
    # the exact-name entries keep layer 1's q/k/v BF16; "o_proj" is an exact name and matches nothing
    assert reference["model.layers.1.self_attn.q_proj"] == "BF16"
    assert reference["model.layers.1.self_attn.o_proj"] == "FP8_BLOCK"
    assert reference["model.layers.0.mlp.down_proj"] == "BF16"  # no group targets the MLP


def test_the_export_loads_strictly_into_the_config_as_written(dense_dir: Path, tmp_path: Path) -> None:
    report = _plan(dense_dir, _file(tmp_path, USER_CONFIG))
    out = tmp_path / "out"
    export_checkpoint(HfCheckpoint(dense_dir), out, report)
    written = json.loads((out / "config.json").read_text())["quantization_config"]
    assert written == USER_CONFIG
    # the KV-cache scales are the engine's (a refit sends none): load the weights only
    weights_only = {k: v for k, v in written.items() if k != "kv_cache_scheme"}
    decompressed = decompress_with_model_compressor(weights_only, load_file(out / "model.safetensors"))
    assert sorted(decompressed) == sorted(m for m, f in _compressed_tensors_schemes(dense_dir, USER_CONFIG).items()
                                          if f != "BF16")


def test_fields_that_cannot_be_honoured_fail_unless_a_rewrite_is_allowed(dense_dir: Path, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    bad = copy.deepcopy(USER_CONFIG)
    bad["sparsity_config"] = {"format": "sparse-24-bitmask", "sparsity_structure": "2:4", "targets": ["Linear"]}
    bad["config_groups"]["attention"]["weights"]["symmetric"] = False
    path = _file(tmp_path, bad)
    with pytest.raises(ConfigNotHonoured) as err:
        _plan(dense_dir, path)
    assert len(err.value.differences) == 2
    assert "sparsity_config" in str(err.value) and "symmetric is false" in str(err.value)
    assert "allow_config_rewrite=true" in str(err.value)
    assert main(["plan", "--model", str(dense_dir), "rollout.name=vllm",
                 f"rollout.quantization.config_file={path}"]) == 2
    assert "ConfigNotHonoured" in capsys.readouterr().err
    report = _plan(dense_dir, path, "rollout.quantization.allow_config_rewrite=true")
    assert not report.resolution.as_written
    assert report.engine_config["kv_cache_scheme"] == USER_CONFIG["kv_cache_scheme"]  # still honoured
    assert not report.engine_config.get("sparsity_config") and "attention" not in report.engine_config["config_groups"]
    as_written = next(o for o in report.resolution.outcomes if o.rule == "ConfigAsWritten")
    assert as_written.outcome.startswith("rewritten") and "sparsity_config" in as_written.outcome
    # rewritten from the presets: every dense Linear is FP8_BLOCK now, in the plan and in the config
    fmt = {d.name: d.format.name for d in report.decisions}
    assert fmt["model.layers.0.mlp.down_proj.weight"] == "FP8_BLOCK"
    assert report.engine_config["config_groups"]["group_0"]["targets"] == ["Linear"]


def test_rollout_quantization_ignore_is_appended_to_a_config_sent_as_written(dense_dir: Path, tmp_path: Path) -> None:
    report = _plan(dense_dir, _file(tmp_path, USER_CONFIG), "rollout.quantization.ignore=[model.layers.0.self_attn.o_proj]")
    assert report.resolution.as_written
    assert report.engine_config["ignore"][:5] == USER_CONFIG["ignore"]
    assert report.engine_config["ignore"][5:] == [r"re:(.*\.)?model\.layers\.0\.self_attn\.o_proj$"]
    fmt = {d.name: d.format.name for d in report.decisions}
    assert fmt["model.layers.0.self_attn.o_proj.weight"] == "BF16"
