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
