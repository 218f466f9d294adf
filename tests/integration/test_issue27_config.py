"""Each defect of "configs that cannot lie, no hang, no internal error" as it was reproduced, with
the behaviour that replaces it.

`ROWS` is the table of command lines: what the user typed, the exit status and the words of the
one-line error now printed (before, these exited 0 with a config that lied, ran for minutes, or
ended in an internal error, exit 3). The functions after it check what a table cannot: the
config an export writes agrees with the tensors it writes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from app.cli.main import main

# id -> (make the command line from tmp_path, exit status, words the stderr line holds)
ROWS: dict[str, tuple[Callable[[Path], list[str]], int, tuple[str, ...]]] = {}


def row(name: str, code: int, *words: str) -> Callable[[Callable[[Path], list[str]]], None]:
    def add(make: Callable[[Path], list[str]]) -> None:
        ROWS[name] = (make, code, words)

    return add


def _write(path: Path, content: str) -> Path:
    path.write_text(content)
    return path


def _model(directory: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3", **(config or {})}))
    return directory


row("C: a dotted override into a key that holds a scalar", 2, "ConfigTypeError",
    "rollout.engine_kwargs.vllm.engine_args.a holds int 1, not a mapping")(
    lambda t: ["plan", "rollout.engine_kwargs.vllm.engine_args.a=1", "rollout.engine_kwargs.vllm.engine_args.a.b=2"])
row("C: an infinite engine start timeout", 2, "rollout.engine_kwargs.vllm.start_timeout_s",
    "finite positive number of seconds")(lambda t: ["plan", "rollout.engine_kwargs.vllm.start_timeout_s=.inf"])
row("C: a fused-forward mode that is none", 2, "FusedForwardModeError", "actor.fused_forward", "'banana'")(
    lambda t: ["plan", "actor.fused_forward=banana"])
row("C: --bucket-mb below one byte", 2, "argument --bucket-mb", "one byte")(
    lambda t: ["demo", "--bucket-mb", "1e-30"])
row("C: a bucket of 1e-30 MiB in the configuration reads as a number", 2, "must hold at least one byte")(
    lambda t: ["plan", "rollout.checkpoint_engine.update_weights_bucket_megabytes=1e-30"])
row("C: --fault-rank without --procs", 2, "--fault-rank", "goes with --procs")(
    lambda t: ["demo", "--fault-rank", "1", "--inject-fault", "bucket:0"])
row("C: a Megatron layout the embedded model's heads do not split over", 2, "--tp: 3 does not divide the 4 attention heads")(
    lambda t: ["demo", "--trainer", "megatron", "--tp", "3"])


FP8_GROUP = {"targets": ["Linear"], "format": "float-quantized",
             "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128],
                         "symmetric": True, "dynamic": False},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128,
                                   "symmetric": True, "dynamic": True}}


def _config_file(t: Path, **fields: object) -> str:
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": FP8_GROUP},
          **fields}
    return str(_write(t / "qc.json", json.dumps(qc)))


def _dense(t: Path) -> str:
    return str(_model(t / "m", {"model.layers.0.self_attn.q_proj.weight": torch.randn(128, 128).bfloat16(),
                                "model.norm.weight": torch.ones(128).bfloat16()}))


row("B: an ignore pattern that backtracks exponentially (it ran for minutes)", 2, "rollout.quantization.ignore",
    "exponential")(lambda t: ["plan", "--model", _dense(t), "rollout.quantization.linear=FP8_BLOCK",
                              "rollout.quantization.ignore='re:(.|.)*Z'"])
row("B: an invalid regex in a config file's ignore list (exit 3)", 2, "rollout.quantization.config_file",
    "ignore[1]", "invalid regular expression '('")(
    lambda t: ["plan", f"rollout.quantization.config_file={_config_file(t, ignore=['lm_head', 're:('])}"])
row("B: a config group's target that backtracks exponentially", 2, "rollout.quantization.config_file",
    "config_groups.group_0.targets[0]", "exponential")(
    lambda t: ["plan", "--model", _dense(t),
               f"rollout.quantization.config_file={_config_file(t, config_groups={'group_0': {**FP8_GROUP, 'targets': ['re:(a|a)*b']}})}"])


def _gptq(t: Path, bits: int = 4, **tensors: torch.Tensor) -> str:
    config = {"quantization_config": {"quant_method": "gptq", "bits": bits, "group_size": 128}}
    q = "model.layers.0.self_attn.q_proj"
    stored = {"lm_head.weight": torch.randn(64, 128).bfloat16(), **{f"{q}.{k}": v for k, v in tensors.items()}}
    return str(_model(t / "gptq", stored, config))


def _gptq_4bit() -> dict[str, torch.Tensor]:
    # K = 128 packed 8 to an int32 along K, N = 256; one group of 128
    return {"qweight": torch.zeros(16, 256, dtype=torch.int32), "qzeros": torch.zeros(1, 32, dtype=torch.int32),
            "scales": torch.ones(1, 256).half(), "g_idx": torch.zeros(128, dtype=torch.int32)}


row("A: an export of a checkpoint with no tensors claimed FP8_BLOCK (exit 0)", 2, "ConfigError",
    "rollout.quantization.linear", "the checkpoint holds no tensors")(
    lambda t: ["export", "--model", str(_model(t / "empty", {})), "--out", str(t / "out"),
               "rollout.quantization.linear=FP8_BLOCK"])
row("A: refit plan said quantized: True for a checkpoint with no tensors", 2, "the checkpoint holds no tensors")(
    lambda t: ["plan", "--model", str(_model(t / "empty", {})), "rollout.quantization.linear=FP8_BLOCK"])
row("A: a config_file compressed-tensors rejects was written through", 2, "rollout.quantization.config_file",
    "compressed-tensors rejects", "kv_cache_scheme", "ignore: Input should be a valid list (got 'lm_head')")(
    lambda t: ["export", "--model", _dense(t), "--out", str(t / "out"),
               f"rollout.quantization.config_file={_config_file(t, ignore='lm_head', kv_cache_scheme='fp8')}"])
row("A: a GPTQ 4-bit config over BF16 tensors was passed through", 2, "NativeLayoutMismatch",
    "'model.layers.0.self_attn.q_proj.weight' is stored as bfloat16", "quant_method 'gptq', 4 bits")(
    lambda t: ["export", "--model", _gptq(t, weight=torch.randn(128, 128).bfloat16()), "--out", str(t / "out")])
row("A: a GPTQ 8-bit config over 4-bit packed tensors", 2, "NativeLayoutMismatch", "q_proj.qweight",
    "not the 8-bit gptq packing")(
    lambda t: ["export", "--model", _gptq(t, bits=8, **_gptq_4bit()), "--out", str(t / "out")])
row("A: GPTQ weights without their scales", 2, "NativeLayoutMismatch", "has no model.layers.0.self_attn.q_proj.scales")(
    lambda t: ["export", "--model", _gptq(t, qweight=torch.zeros(16, 256, dtype=torch.int32)), "--out", str(t / "out")])


@pytest.mark.parametrize("name", list(ROWS))
def test_row(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make, code, words = ROWS[name]
    start = time.monotonic()
    assert main(make(tmp_path)) == code
    err = capsys.readouterr().err.strip()
    assert time.monotonic() - start < 60
    assert "\n" not in err and "Traceback" not in err and "internal error" not in err, err
    for word in words:
        assert word in err, (word, err)


def test_a_missing_engine_host_python_is_named(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RL_REFIT_VLLM_PYTHON", "/nonexistent/bin/python")
    assert main(["demo", "--engine", "vllm", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "ConfigError: RL_REFIT_VLLM_PYTHON: '/nonexistent/bin/python' does not exist" in err


def test_a_gptq_checkpoint_that_is_what_its_config_says_passes_through(tmp_path: Path) -> None:
    src = _gptq(tmp_path, **_gptq_4bit())
    assert main(["export", "--model", src, "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["quant_method"] == "gptq"


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
    from safetensors.torch import load_file

    src = _model(tmp_path / "m", {
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
