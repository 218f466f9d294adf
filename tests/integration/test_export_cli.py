"""`refit plan` and `refit export` end to end on tiny local checkpoints: output, exit codes,
atomicity, native layouts (SGLang MXFP8, DeepSeek-style FP8, pass-through)."""

from __future__ import annotations

import builtins
import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="building the tiny HF models needs transformers")
pytest.importorskip("compressed_tensors", reason="the engine config is built with compressed-tensors")

from safetensors.torch import load_file

from adapters.hf_checkpoint import writer as writer_module
from adapters.profiles import dispatch_for
from app.cli.main import main
from domain.quant.codecs import quantize_weight
from domain.quant.dispatch import rule_names
from domain.quant.formats import FP8_BLOCK, MXFP8
from tests.integration.export_models import save_tiny_model

pytestmark = pytest.mark.usefixtures("cli_logging_to_this_tests_stderr")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("qwen3moe"), moe=True)


def _with_config(src: Path, dst: Path, **changes: object) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_plan_json_lists_every_tensor_and_the_engine_config(moe_dir: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(["plan", "--model", str(moe_dir), "--json", "rollout.name=vllm", "rollout.quantization.linear=FP8_BLOCK",
               "rollout.quantization.moe=NVFP4", "rollout.quantization.moe_activation=none"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["tensors"]) == len(load_file(moe_dir / "model.safetensors"))
    assert out["plan"]["layout"] == "compressed-tensors" and out["engine_config"]["format"] == "mixed-precision"
    fmt = {t["name"]: t["format"] for t in out["tensors"]}
    assert fmt["model.layers.1.self_attn.o_proj.weight"] == "FP8_BLOCK"
    assert fmt["model.layers.1.mlp.experts.3.up_proj.weight"] == "NVFP4"
    assert fmt["model.layers.1.mlp.gate.weight"] == "BF16"
    assert [r["rule"] for r in out["rules"]] == list(rule_names(dispatch_for("vllm")))  # by name, in the order run
    assert next(r for r in out["rules"] if r["rule"] == "BlockDivisibility") == {
        "rule": "BlockDivisibility", "check": "block-divisible K", "outcome": "ok"}
    up = next(c for c in out["tensor_classes"] if c["tensors"] == "model.layers.*.mlp.experts.*.up_proj.weight")
    assert up["count"] == 8 and up["group"] == "model.layers.*.mlp.experts.*.gate_up"


def test_plan_table_without_a_model(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "rollout.quantization.moe=MXFP4", "rollout.quantization.moe_activation=mxfp8"]) == 0
    text = capsys.readouterr().out
    assert "MXFP4" in text and "mxfp8" in text and "skipped: no model given" in text


def test_plan_shows_the_rule_of_every_format_with_its_reason(capsys: pytest.CaptureFixture) -> None:
    args = ["plan", "rollout.quantization.linear=FP8_BLOCK", "rollout.quantization.moe=MXFP4",
            "rollout.quantization.moe_activation=mxfp8"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["numerics"] == "engine" and out["plan"]["scale_rule"] is None
    rows = {r["format"]: r for r in out["numerics"]}
    assert list(rows) == ["FP8_BLOCK", "MXFP4", "MXFP8"]
    assert rows["FP8_BLOCK"]["roles"] == ["weights", "activations"] and rows["FP8_BLOCK"]["scale_rule"] is None
    assert "per_block_cast_to_fp8" in rows["FP8_BLOCK"]["reference"]
    assert (rows["MXFP4"]["scale_rule"], rows["MXFP8"]["scale_rule"]) == ("even", "rceil")
    assert rows["MXFP8"]["roles"] == ["activations"] and "engine quantizer" in rows["MXFP8"]["reason"]
    assert main([*args, "rollout.quantization.numerics=compressed-tensors", "--json"]) == 0
    rows = {r["format"]: r for r in json.loads(capsys.readouterr().out)["numerics"]}
    assert {r["element_rule"] for r in rows.values()} == {"compressed-tensors"}
    assert rows["MXFP8"]["scale_rule"] == "even" and "llm-compressor" in rows["MXFP8"]["reason"]
    assert main([*args, "rollout.quantization.scale_rule=rceil", "--json"]) == 0
    rows = {r["format"]: r for r in json.loads(capsys.readouterr().out)["numerics"]}
    assert rows["MXFP4"]["scale_rule"] == "rceil" and "set by rollout.quantization.scale_rule" in rows["MXFP4"]["reason"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "numerics: element rule engine" in text and "x * (1.0 / scale)" in text


def test_plan_rejects_an_unknown_element_rule(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "rollout.quantization.linear=NVFP4", "rollout.quantization.numerics=llm-compressor"]) == 2
    err = capsys.readouterr().err
    assert "rollout.quantization.numerics" in err and "engine, compressed-tensors" in err


def test_plan_rejects_with_exit_code_2_and_the_error_on_stderr(capsys: pytest.CaptureFixture) -> None:
    rc = main(["plan", "--json", "rollout.name=sglang", "rollout.quantization.linear=MXFP8", "rollout.quantization.moe=MXFP4"])
    captured = capsys.readouterr()
    assert rc == 2
    assert "EngineCellUnsupported" in captured.err and "linear=MXFP8" in captured.err
    assert json.loads(captured.out)["error"]["type"] == "EngineCellUnsupported"
    assert main(["plan", "rollout.quantization.lienar=FP8_BLOCK"]) == 2
    assert "did you mean 'rollout.quantization.linear'" in capsys.readouterr().err


def test_export_refuses_a_non_empty_directory_unless_forced(moe_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    args = ["export", "--model", str(moe_dir), "--out", str(out), "--json", "rollout.quantization.moe=MXFP8"]
    assert main(args) == 2
    assert "OutputNotEmpty" in capsys.readouterr().err and (out / "keep.txt").exists()
    assert main([*args, "--force"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert not (out / "keep.txt").exists() and (out / "config.json").exists()
    assert result["tensors_out"] == len(load_file(out / "model.safetensors")) and result["layout"] == "compressed-tensors"


def test_failed_export_leaves_nothing_behind(moe_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture) -> None:
    class FullDisk:  # a shard file on a disk that fills up at the tenth write
        writes = 0

        def __init__(self, file: Any) -> None:
            self._file = file

        def write(self, data: Any) -> int:
            FullDisk.writes += 1
            if FullDisk.writes == 10:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self._file.write(data)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._file, name)

    monkeypatch.setattr(writer_module, "open", lambda *a, **k: FullDisk(builtins.open(*a, **k)),  # noqa: SIM115
                        raising=False)
    out = tmp_path / "out"
    assert main(["export", "--model", str(moe_dir), "--out", str(out), "rollout.quantization.linear=NVFP4"]) == 2
    err = capsys.readouterr().err
    assert "OutputNotWritable" in err and "No space left on device; free some space" in err
    assert list(tmp_path.iterdir()) == []  # no partial directory, no lock file


def test_export_shards_and_index(moe_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["export", "--model", str(moe_dir), "--out", str(out), "--shard-size-mb", "0.05",
                 "--json", "rollout.quantization.linear=MXFP4"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0].startswith("model-00001-of-")
    loaded = {}
    for s in shards:
        loaded.update(load_file(out / s))
    assert set(loaded) == set(index["weight_map"]) and index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in loaded.values())


def test_sglang_all_mxfp8_is_exported_in_sglang_native_layout(moe_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["export", "--model", str(moe_dir), "--out", str(out), "rollout.name=sglang",
                 "rollout.quantization.linear=MXFP8", "rollout.quantization.moe=MXFP8"]) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "mxfp8" and qc["weight_block_size"] == [1, 32]
    assert "model.layers.0.mlp.gate" in qc["ignored_layers"] and "lm_head" in qc["ignored_layers"]
    exported, src = load_file(out / "model.safetensors"), load_file(moe_dir / "model.safetensors")
    assert not any(k.endswith(".weight_scale") for k in exported)
    ref = quantize_weight(MXFP8, src["model.layers.0.self_attn.o_proj.weight"])
    assert torch.equal(exported["model.layers.0.self_attn.o_proj.weight_scale_inv"], ref.tensors["weight_scale"])


def test_deepseek_style_fp8_checkpoint_is_recognised(moe_dir: Path, tmp_path: Path) -> None:
    native = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
              "modules_to_not_convert": ["model.layers.0.self_attn.o_proj"]}
    src = _with_config(moe_dir, tmp_path / "src", quantization_config=native)
    out = tmp_path / "out"
    assert main(["export", "--model", str(src), "--out", str(out), "rollout.name=vllm"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == native
    exported, weights = load_file(out / "model.safetensors"), load_file(moe_dir / "model.safetensors")
    ref = quantize_weight(FP8_BLOCK, weights["model.layers.1.self_attn.o_proj.weight"])
    assert torch.equal(exported["model.layers.1.self_attn.o_proj.weight_scale_inv"], ref.tensors["weight_scale"])
    assert torch.equal(exported["model.layers.0.self_attn.o_proj.weight"], weights["model.layers.0.self_attn.o_proj.weight"])


def _gpt_oss_like(moe_dir: Path, dst: Path, native: dict) -> Path:
    """The tiny MoE with its experts stored as GPT-OSS stores mxfp4 experts: fused
    `gate_up_proj_blocks` / `down_proj_blocks` (uint8 [E, N, K / 32, 16]) and their E8M0 scales."""
    from safetensors.torch import save_file

    source = load_file(moe_dir / "model.safetensors")
    tensors = {k: v for k, v in source.items() if ".mlp.experts." not in k}
    layers = {k.split(".mlp.experts.")[0] for k in source if ".mlp.experts." in k}
    for layer in layers:
        experts = len({k for k in source if k.startswith(f"{layer}.mlp.experts.") and k.endswith("down_proj.weight")})
        inter, hidden = source[f"{layer}.mlp.experts.0.gate_proj.weight"].shape
        for proj, (n, k) in (("gate_up_proj", (2 * inter, hidden)), ("down_proj", (hidden, inter))):
            p = f"{layer}.mlp.experts.{proj}"
            tensors[f"{p}_blocks"] = torch.randint(0, 256, (experts, n, k // 32, 16), dtype=torch.uint8)
            tensors[f"{p}_scales"] = torch.full((experts, n, k // 32), 127, dtype=torch.uint8)
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((moe_dir / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": native}))
    return dst


def test_unsupported_native_method_passes_through_untouched(moe_dir: Path, tmp_path: Path) -> None:
    native = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    src = _gpt_oss_like(moe_dir, tmp_path / "src", native)
    out = tmp_path / "out"
    assert main(["export", "--model", str(src), "--out", str(out), "rollout.name=vllm"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"] == native
    a, b = load_file(out / "model.safetensors"), load_file(src / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert main(["export", "--model", str(src), "--out", str(tmp_path / "o2"), "actor.megatron.qat.enable=true",
                 "actor.megatron.qat.mode=MXFP4"]) == 2


def test_a_native_config_that_lies_about_its_tensors_is_not_passed_through(
        moe_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # An mxfp4 config over BF16 experts was copied as it is: the engine would read BF16 bytes as mxfp4.
    native = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    src = _with_config(moe_dir, tmp_path / "src", quantization_config=native)
    assert main(["export", "--model", str(src), "--out", str(tmp_path / "out"), "rollout.name=vllm"]) == 2
    err = capsys.readouterr().err
    assert "NativeLayoutMismatch: tensor 'model.layers.0.mlp.experts.0.down_proj.weight' is stored as bfloat16" in err
    assert "quant_method 'mxfp4'" in err and "more tensors do not match" in err
    assert not (tmp_path / "out").exists()


def test_hf_overrides_null_exports_bf16_from_a_quantized_checkpoint(moe_dir: Path, tmp_path: Path) -> None:
    native = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    src = _with_config(moe_dir, tmp_path / "src", text_config={"quantization_config": native})
    out = tmp_path / "out"
    assert main(["export", "--model", str(src), "--out", str(out), "rollout.name=vllm",
                 "rollout.engine_kwargs.vllm.hf_overrides={\"quantization_config\": null}"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and "quantization_config" not in config["text_config"]
    assert set(load_file(out / "model.safetensors")) == set(load_file(moe_dir / "model.safetensors"))


def test_vision_language_and_gated_deltanet_names(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from tests.integration.export_models import decompress_with_model_compressor

    src = tmp_path / "src"
    src.mkdir()
    p = "model.language_model.layers"
    tensors = {
        "model.language_model.embed_tokens.weight": torch.randn(64, 64),
        "model.visual.blocks.0.attn.qkv.weight": torch.randn(96, 64),
        f"{p}.0.linear_attn.in_proj_qkvz.weight": torch.randn(128, 64),
        f"{p}.0.linear_attn.in_proj_ba.weight": torch.randn(8, 64),
        f"{p}.0.linear_attn.conv1d.weight": torch.randn(96, 1, 4),
        f"{p}.0.linear_attn.A_log": torch.randn(4),
        f"{p}.0.linear_attn.out_proj.weight": torch.randn(64, 64),
        f"{p}.1.self_attn.q_proj.weight": torch.randn(64, 64),
        f"{p}.1.self_attn.k_proj.weight": torch.randn(32, 64),
        f"{p}.1.self_attn.v_proj.weight": torch.randn(32, 64),
        "lm_head.weight": torch.randn(64, 64),
    }
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": {"num_hidden_layers": 2}}))
    out = tmp_path / "out"
    assert main(["export", "--model", str(src), "--out", str(out), "rollout.name=vllm", "rollout.quantization.linear=NVFP4",
                 "rollout.quantization.linear_activation=none"]) == 0
    exported = load_file(out / "model.safetensors")
    for kept in ("model.visual.blocks.0.attn.qkv.weight", f"{p}.0.linear_attn.in_proj_ba.weight",
                 f"{p}.0.linear_attn.conv1d.weight", "model.language_model.embed_tokens.weight", "lm_head.weight"):
        assert exported[kept].dtype == torch.bfloat16, kept
    assert exported[f"{p}.1.self_attn.k_proj.weight_global_scale"] == exported[f"{p}.1.self_attn.q_proj.weight_global_scale"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    decompressed = decompress_with_model_compressor(qc, exported)
    assert sorted(decompressed) == sorted([f"{p}.0.linear_attn.in_proj_qkvz", f"{p}.0.linear_attn.out_proj",
                                           f"{p}.1.self_attn.q_proj", f"{p}.1.self_attn.k_proj", f"{p}.1.self_attn.v_proj"])


# --- drop-in for verl users ------------------------------------------------------------------------

VERL_YAML = Path(__file__).resolve().parents[1] / "data" / "verl_ppo_megatron.yaml"
V4_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}


# verl's NVFP4 QAT recipe served weight-only (vLLM has no per-token NVFP4 for compressed-tensors)
NVFP4_PER_TOKEN = ["actor.megatron.qat.mode=nvfp4", "rollout.quantization.linear=NVFP4", "rollout.quantization.moe=NVFP4"]


def test_a_verl_yaml_runs_through_plan_unchanged(moe_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", str(VERL_YAML), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["engine"], out["plan"]["linear"], out["plan"]["moe"]) == ("vllm", "FP8_BLOCK", "FP8_BLOCK")
    assert next(r for r in out["rules"] if r["rule"] == "QatMatchesRollout")["outcome"] == "ok"  # qat.mode fp8 matches the rollout
    assert "data" in out["unused_keys"] and out["engine_config"]["config_groups"]
    assert main(["plan", str(VERL_YAML), "--model", str(moe_dir)]) == 0  # per tensor too
    assert "keys of the verl configuration are not read" in capsys.readouterr().out
    # verl's NVFP4 QAT asks vLLM for per-token NVFP4 activations, which the support matrix refuses
    assert main(["plan", str(VERL_YAML), *NVFP4_PER_TOKEN, "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["type"] == "EngineCellUnsupported"


def test_plan_rejects_a_release_layout_fp8_model_with_delta_sync_naming_the_rule(
        moe_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = _with_config(moe_dir, tmp_path / "v4", model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"],
                       quantization_config=V4_FP8)
    assert main(["plan", "--model", str(src), "rollout.name=vllm"]) == 0  # NativeReleaseLayout: passes through
    capsys.readouterr()
    assert main(["plan", "--model", str(src), "rollout.name=vllm", "rollout.checkpoint_engine.backend=delta_sharded"]) == 2
    err = capsys.readouterr().err
    assert "QuantizedDeltaSync" in err and "dispatch rule QuantizedFullSync" in err


def test_plan_refuses_a_refit_of_a_native_layout_the_trainer_cannot_produce(
        moe_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = _with_config(moe_dir, tmp_path / "gptoss", quantization_config={"quant_method": "mxfp4"})
    assert main(["plan", "--model", str(src), "rollout.name=vllm"]) == 2
    err = capsys.readouterr().err
    assert "NativeRefitUnsupported" in err and "dispatch rule UnexportableNativeMethod" in err and "BF16 tensors" in err
    assert main(["plan", "--model", str(src), "rollout.name=vllm", "rollout.quantization.moe=MXFP4"]) == 0


def test_vllm_per_token_nvfp4_experts_export_in_modelopts_layout(moe_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "modelopt"
    assert main(["export", "--model", str(moe_dir), "--out", str(out), "rollout.name=vllm",
                 "rollout.quantization.moe=NVFP4", "rollout.quantization.ignore=['re:.*layers\\.0\\..*']"]) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"], qc["group_size"]) == ("modelopt", "NVFP4", 16)
    assert "model.layers.0.mlp.experts" in qc["ignore"] and "lm_head" in qc["ignore"]
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    experts = [n for n in tensors if ".mlp.experts." in n and not n.startswith("model.layers.0.")]
    assert experts and not any(n.endswith(("weight_packed", "weight_global_scale")) for n in tensors)
    gate = next(n.removesuffix(".weight_scale_2") for n in experts if n.endswith("gate_proj.weight_scale_2"))
    assert tensors[f"{gate}.weight"].dtype == torch.uint8 and tensors[f"{gate}.weight_scale"].dtype == torch.float8_e4m3fn
    scale_2 = tensors[f"{gate}.weight_scale_2"]
    assert scale_2.shape == () and scale_2.dtype == torch.float32
    assert torch.equal(scale_2, tensors[f"{gate.removesuffix('gate_proj')}up_proj.weight_scale_2"])  # shared
    layer0 = [n for n in tensors if n.startswith("model.layers.0.mlp.experts.")]
    assert layer0 and all(tensors[n].dtype == torch.bfloat16 for n in layer0)  # kept BF16 by the ignore entry
