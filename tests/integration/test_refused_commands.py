"""A command `refit` refuses ends in one line naming what to change, with exit status 2, within
a minute, and changes no file: corrupt or malformed checkpoints, configurations and overrides
that cannot be honoured, arguments out of range, outputs that overlap the model, input files that
are no regular files. An internal error is one line too (exit 3), its traceback behind --debug.

`ROWS` is the table of command lines: what the user typed, the exit status and the words of the
one-line error printed. Before, many of these were tracebacks, ran for minutes, or exited 0 with
a config that lied about its tensors. The functions after it check what a table cannot.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from app.cli.main import main
from tests.integration.export_models import (
    copy_model,
    gptq_4bit,
    gptq_model,
    model_dir,
    one_line,
    tiny_checkpoint,
)

EXPORT = ["rollout.quantization.linear=NVFP4", "rollout.quantization.moe=MXFP4"]
FP8_EXPORT = ["rollout.quantization.linear=FP8_BLOCK"]


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("src") / "model")


def _safetensors(header: object, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _corrupt(kind: str) -> Callable[[Path], None]:
    def change(file: Path) -> None:
        good = file.read_bytes()
        n = struct.unpack("<Q", good[:8])[0]
        header = json.loads(good[8 : 8 + n])
        name = next(k for k in header if k != "__metadata__")
        data = {
            "empty": b"",
            "eight_bytes_short": good[:5],
            "header_length_too_large": struct.pack("<Q", 2**62) + good[8:],
            "header_not_json": struct.pack("<Q", 10) + b"not json!!" + good[8 + n:],
            "truncated_data": good[: len(good) // 2],
            "header_a_list": _safetensors([1, 2, 3]),
            "unknown_dtype": _safetensors({**header, name: {**header[name], "dtype": "Q9"}}, good[8 + n:]),
            "offsets_beyond_the_file": _safetensors({**header, name: {**header[name], "data_offsets": [0, 10**12]}},
                                                    good[8 + n:]),
        }[kind]
        file.write_bytes(data)

    return change


def _text(content: str | bytes) -> Callable[[Path], None]:
    return lambda f: f.write_bytes(content if isinstance(content, bytes) else content.encode())


def _index(weight_map: object) -> Callable[[Path], None]:
    return _text(json.dumps({"weight_map": weight_map}))


def _write(path: Path, data: str | bytes) -> Path:
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def _link(link: Path, target: Path) -> Path:
    link.symlink_to(target)
    return link


def _dense_mlp(t: Path) -> Path:
    d = t / "dense"
    d.mkdir()
    save_file({"model.layers.0.mlp.down_proj.weight": torch.randn(64, 64).to(torch.bfloat16)}, d / "model.safetensors")
    (d / "config.json").write_text("{}")
    return d


def _linked_model(s: Path, t: Path) -> Path:
    """A Hugging Face cache layout: the model's files are symlinks into a blobs directory."""
    (t / "blobs").mkdir()
    m = t / "snapshot"
    m.mkdir()
    for f in s.iterdir():
        (t / "blobs" / f.name).write_bytes(f.read_bytes())
        (m / f.name).symlink_to(t / "blobs" / f.name)
    return m


def _int4_model(t: Path) -> Path:
    d = t / "int4"
    d.mkdir()
    save_file({"model.layers.0.mlp.down_proj.weight_packed": torch.zeros(64, 8, dtype=torch.int32),
               "model.layers.0.mlp.down_proj.weight_scale": torch.ones(64, 2, dtype=torch.bfloat16)}, d / "model.safetensors")
    (d / "config.json").write_text("{}")
    return d


def _dense_attention(t: Path) -> str:
    return str(model_dir(t / "m", {"model.layers.0.self_attn.q_proj.weight": torch.randn(128, 128).bfloat16(),
                                   "model.norm.weight": torch.ones(128).bfloat16()}))


FP8_GROUP = {"targets": ["Linear"], "format": "float-quantized",
             "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128],
                         "symmetric": True, "dynamic": False},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128,
                                   "symmetric": True, "dynamic": True}}


def _config_file(t: Path, **fields: object) -> str:
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": FP8_GROUP},
          **fields}
    return str(_write(t / "qc.json", json.dumps(qc)))


# id -> (make the command line from (tmp_path, the tiny model), exit status, words the stderr line holds)
ROWS: dict[str, tuple[Callable[[Path, Path], list[str]], int, tuple[str, ...]]] = {}


def row(name: str, code: int, *words: str) -> Callable[[Callable[[Path, Path], list[str]]], None]:
    def add(make: Callable[[Path, Path], list[str]]) -> None:
        ROWS[name] = (make, code, words)

    return add


# --- checkpoints that cannot be read -------------------------------------------------------------

for kind in ("empty", "eight_bytes_short", "header_length_too_large", "header_not_json", "truncated_data",
             "header_a_list", "unknown_dtype", "offsets_beyond_the_file"):
    row(f"corrupt safetensors: {kind}", 2, "CheckpointError", "not a readable safetensors file")(
        lambda t, s, kind=kind: ["plan", "--model", str(copy_model(s, t / "m", model__safetensors=_corrupt(kind)))])
for name, content, words in (
    ("not JSON", "{oops", ("not valid JSON",)),
    ("a list", "[1, 2]", ("not a safetensors index",)),
    ("weight_map not an object", json.dumps({"weight_map": [1]}), ("not a safetensors index",)),
    ("names a missing file", json.dumps({"weight_map": {"lm_head.weight": "gone.safetensors"}}), ("not in",)),
    ("names a tensor the file lacks", json.dumps({"weight_map": {"nope.weight": "model.safetensors"}}),
     ("not in the file the index names",)),
    ("not UTF-8", b"\xff\xfe{}", ("not UTF-8",)),
):
    row(f"malformed index: {name}", 2, "CheckpointError", *words)(
        lambda t, s, c=content: ["plan", "--model", str(copy_model(s, t / "m", model__safetensors__index__json=_text(c)))])
row("config.json is not an object", 2, "CheckpointError", "config.json must be an object")(
    lambda t, s: ["plan", "--model", str(copy_model(s, t / "m", config__json=_text("[1]")))])
row("index weight_map paths that leave the model directory", 2, "CheckpointError", "inside the model directory")(
    lambda t, s: ["plan", "--model", str(copy_model(s, t / "m", model__safetensors__index__json=_index(
        {"lm_head.weight": "../../other/model.safetensors"})))])
row("a source without config.json", 2, "CheckpointError", "has no config.json")(
    lambda t, s: ["export", "--model", str(copy_model(s, t / "m", config__json=lambda f: f.unlink())), "--out", str(t / "o"),
                  *EXPORT])
row("--model names a file", 2, "CheckpointError", "is not a directory")(lambda t, s: ["plan", "--model", "/dev/null"])
row("a stored layout rl-refit cannot decode", 2, "QuantizedSource", "weight_packed int32")(
    lambda t, s: ["export", "--model", str(_int4_model(t)), "--out", str(t / "o"), *EXPORT])

# --- configurations, overrides and arguments -----------------------------------------------------

row("a non-UTF-8 configuration file", 2, "ConfigError", "not UTF-8")(
    lambda t, s: ["plan", str(_write(t / "c.yaml", b"rollout:\n  name: \xff\n"))])
row("extreme nesting in an override", 2, "ConfigError", "rollout.quantization.ignore")(
    lambda t, s: ["plan", "rollout.quantization.ignore=" + "[" * 5000 + "]" * 5000])
row("an over-long integer in an override", 2, "ConfigError", "rollout.checkpoint_engine.update_weights_bucket_megabytes")(
    lambda t, s: ["plan", "rollout.checkpoint_engine.update_weights_bucket_megabytes=" + "9" * 5000])
row("an override that is not valid YAML", 2, "ConfigError", "rollout.quantization.ignore", "not valid YAML",
    "quote it", "rollout.quantization.ignore=[lm_head, 're:.*layers\\.0\\..*']")(
    lambda t, s: ["plan", 'rollout.quantization.ignore=[lm_head, "re:.*layers\\.0\\..*"]'])
row("the configuration file is a directory", 2, "ConfigError", "is a directory")(lambda t, s: ["plan", str(t)])
row("rollout=5", 2, "ConfigTypeError", "is a section, not a value")(lambda t, s: ["plan", "rollout=5"])
row("a dotted override into a key that holds a scalar", 2, "ConfigTypeError",
    "rollout.engine_kwargs.vllm.engine_args.a holds int 1, not a mapping")(
    lambda t, s: ["plan", "rollout.engine_kwargs.vllm.engine_args.a=1", "rollout.engine_kwargs.vllm.engine_args.a.b=2"])
row("an infinite engine start timeout", 2, "rollout.engine_kwargs.vllm.start_timeout_s",
    "finite positive number of seconds")(lambda t, s: ["plan", "rollout.engine_kwargs.vllm.start_timeout_s=.inf"])
row("a fused-forward mode that is none", 2, "FusedForwardModeError", "actor.fused_forward", "'banana'")(
    lambda t, s: ["plan", "actor.fused_forward=banana"])
row("a bucket of 1e-30 MiB in the configuration reads as a number", 2, "must hold at least one byte")(
    lambda t, s: ["plan", "rollout.checkpoint_engine.update_weights_bucket_megabytes=1e-30"])
row("moe=NVFP4 on a dense model", 2, "ConfigError", "rollout.quantization.moe", "no tensor of this model")(
    lambda t, s: ["plan", "--model", str(_dense_mlp(t)), "rollout.quantization.moe=NVFP4"])
row("doctor --environment on a JSON list", 2, "ConfigError", "--environment", "JSON list")(
    lambda t, s: ["doctor", "--environment", str(_write(t / "env.json", b"[1, 2]"))])
row("refit demo --bucket-mb nan", 2, "argument --bucket-mb", "above 0")(lambda t, s: ["demo", "--bucket-mb", "nan"])
row("refit demo --bucket-mb below one byte", 2, "argument --bucket-mb", "one byte")(
    lambda t, s: ["demo", "--bucket-mb", "1e-30"])
row("refit demo --seed 10**30", 2, "argument --seed", "from 0 to")(lambda t, s: ["demo", "--seed", str(10**30)])
row("refit demo --plot in a missing directory", 2, "argument --plot", "does not exist")(
    lambda t, s: ["demo", "--plot", str(t / "missing" / "m.png")])
row("refit demo --plot names a directory", 2, "argument --plot", "is a directory", "mismatch.png")(
    lambda t, s: ["demo", "--plot", str(t)])
row("refit demo --fault-rank without procs", 2, "--fault-rank", "it is an option of `refit demo procs`")(
    lambda t, s: ["demo", "--fault-rank", "1", "--inject-fault", "bucket:0"])
row("a Megatron layout the embedded model's heads do not split over", 2,
    "--tp: 3 does not divide the 4 attention heads")(lambda t, s: ["demo", "megatron", "--tp", "3"])

# --- regular expressions with unbounded work -----------------------------------------------------

row("an ignore pattern that backtracks exponentially (it ran for minutes)", 2, "rollout.quantization.ignore",
    "exponential")(lambda t, s: ["plan", "--model", _dense_attention(t), "rollout.quantization.linear=FP8_BLOCK",
                                 "rollout.quantization.ignore='re:(.|.)*Z'"])
row("an invalid regex in a config file's ignore list", 2, "rollout.quantization.config_file",
    "ignore[1]", "invalid regular expression '('")(
    lambda t, s: ["plan", f"rollout.quantization.config_file={_config_file(t, ignore=['lm_head', 're:('])}"])
row("a config group's target that backtracks exponentially", 2, "rollout.quantization.config_file",
    "config_groups.group_0.targets[0]", "exponential")(
    lambda t, s: ["plan", "--model", _dense_attention(t),
                  f"rollout.quantization.config_file={_config_file(t, config_groups={'group_0': {**FP8_GROUP, 'targets': ['re:(a|a)*b']}})}"])

# --- exports whose config would lie about their tensors ------------------------------------------

row("an export of a checkpoint with no tensors", 2, "ConfigError",
    "rollout.quantization.linear", "the checkpoint holds no tensors")(
    lambda t, s: ["export", "--model", str(model_dir(t / "empty", {})), "--out", str(t / "out"),
                  "rollout.quantization.linear=FP8_BLOCK"])
row("refit plan of a checkpoint with no tensors", 2, "the checkpoint holds no tensors")(
    lambda t, s: ["plan", "--model", str(model_dir(t / "empty", {})), "rollout.quantization.linear=FP8_BLOCK"])
row("a config_file compressed-tensors rejects", 2, "rollout.quantization.config_file",
    "compressed-tensors rejects", "kv_cache_scheme", "ignore: Input should be a valid list (got 'lm_head')")(
    lambda t, s: ["export", "--model", _dense_attention(t), "--out", str(t / "out"),
                  f"rollout.quantization.config_file={_config_file(t, ignore='lm_head', kv_cache_scheme='fp8')}"])
row("a GPTQ 4-bit config over BF16 tensors", 2, "NativeLayoutMismatch",
    "'model.layers.0.self_attn.q_proj.weight' is stored as bfloat16", "quant_method 'gptq', 4 bits")(
    lambda t, s: ["export", "--model", gptq_model(t, weight=torch.randn(128, 128).bfloat16()), "--out", str(t / "out")])
row("a GPTQ 8-bit config over 4-bit packed tensors", 2, "NativeLayoutMismatch", "q_proj.qweight",
    "not the 8-bit gptq packing")(
    lambda t, s: ["export", "--model", gptq_model(t, bits=8, **gptq_4bit()), "--out", str(t / "out")])
row("GPTQ weights without their scales", 2, "NativeLayoutMismatch", "has no model.layers.0.self_attn.q_proj.scales")(
    lambda t, s: ["export", "--model", gptq_model(t, qweight=torch.zeros(16, 256, dtype=torch.int32)),
                  "--out", str(t / "out")])

# --- outputs that overlap the model --------------------------------------------------------------

row("--out . in a non-empty working directory", 2, "OutputNotEmpty", "is not empty")(
    lambda t, s: ["export", "--model", str(s), "--out", ".", *EXPORT])
row("--shard-size-mb 0", 2, "argument --shard-size-mb", "above 0")(
    lambda t, s: ["export", "--model", str(s), "--out", str(t / "o"), "--shard-size-mb", "0", *EXPORT])
row("--force with --out the parent of --model", 2, "OutputOverlapsModel", "contains the model directory")(
    lambda t, s: ["export", "--model", str(copy_model(s, t / "parent" / "m")), "--out", str(t / "parent"), "--force", *EXPORT])
row("--out inside --model", 2, "OutputOverlapsModel", "is inside the model directory")(
    lambda t, s: ["export", "--model", str(copy_model(s, t / "m")), "--out", str(t / "m" / "out"), "--force", *EXPORT])
row("--out a symlink to --model", 2, "OutputOverlapsModel", "is the model directory")(
    lambda t, s: ["export", "--model", str(copy_model(s, t / "m")), "--out", str(_link(t / "link", t / "m")), "--force", *EXPORT])
row("a model file symlinked into --out", 2, "OutputOverlapsModel", "resolves to")(
    lambda t, s: ["export", "--model", str(_linked_model(s, t)), "--out", str(t / "blobs"), "--force", *EXPORT])


@pytest.mark.parametrize("name", list(ROWS))
def test_a_refused_command_is_one_line_within_a_minute_and_changes_no_file(
        name: str, src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    make, code, words = ROWS[name]
    work = tmp_path / "cwd"
    work.mkdir()
    (work / "keep.txt").write_text("x")
    monkeypatch.chdir(work)
    argv = make(tmp_path, src)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink()}
    start = time.monotonic()
    assert main(argv) == code
    assert time.monotonic() - start < 60
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0] and "internal error" not in err[0], err  # one line
    for w in words:
        assert w in err[0], (w, err[0])
    after = {p: p.read_bytes() for p in before if p.exists()}
    assert after == before, "a refused command changed or deleted files"


def test_an_internal_error_is_one_line_and_debug_shows_the_traceback(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture) -> None:
    import app.cli.plan

    def broken(_args: Any) -> int:
        raise KeyError("boom")

    monkeypatch.setattr(app.cli.plan, "run", broken)
    assert main(["plan"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error: KeyError" in err and "--debug" in err
    assert main(["plan", "--debug"]) == 3
    assert "Traceback (most recent call last)" in capsys.readouterr().err
    assert main(["--debug", "plan"]) == 3
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_a_missing_engine_host_python_is_named(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RL_REFIT_VLLM_PYTHON", "/nonexistent/bin/python")
    assert main(["demo", "vllm", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "ConfigError: RL_REFIT_VLLM_PYTHON: '/nonexistent/bin/python' does not exist" in err


# --- input files that are no regular files; symlink loops -----------------------------------------

def _fifo_environment(t: Path, fifo: Path, s: Path) -> list[str]:
    return ["doctor", "--environment", str(fifo)]


def _fifo_config(t: Path, fifo: Path, s: Path) -> list[str]:
    return ["plan", str(fifo)]


def _fifo_config_file(t: Path, fifo: Path, s: Path) -> list[str]:
    return ["plan", f"rollout.quantization.config_file={fifo}"]


def _fifo_model_config(t: Path, fifo: Path, s: Path) -> list[str]:
    model = tiny_checkpoint(t / "m")
    (model / "config.json").unlink()
    (model / "config.json").symlink_to(fifo)  # a FIFO where the config should be
    return ["export", "--model", str(model), "--out", str(t / "o"), *FP8_EXPORT]


@pytest.mark.parametrize(("make", "words"), [
    (_fifo_environment, ("ConfigError: --environment", "is a FIFO, not a regular file")),
    (_fifo_config, ("ConfigError: CONFIG", "not a regular file")),
    (_fifo_config_file, ("ConfigError: rollout.quantization.config_file", "not a regular file")),
    (_fifo_model_config, ("CheckpointError", "is a FIFO, not a regular file")),
], ids=["doctor --environment", "CONFIG", "config_file", "the model's config.json"])
def test_an_input_file_that_is_a_fifo_is_refused_without_blocking(
        make: Callable[[Path, Path, Path], list[str]], words: tuple[str, ...], src: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    argv = make(tmp_path, fifo, src)
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(main(argv)), daemon=True)
    worker.start()
    worker.join(60)
    if worker.is_alive():  # before (doctor --environment): blocked forever on the open; give it a writer
        with open(fifo, "w"):
            pass
        worker.join(10)
        pytest.fail(f"refit {argv[0]} blocked on the FIFO")
    assert result == [2]
    one_line(capsys, *words)


def test_a_weight_file_that_is_a_symlink_loop_is_a_one_line_error(src: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    model = tiny_checkpoint(tmp_path / "m")
    (model / "loop.safetensors").symlink_to(model / "loop.safetensors")
    assert main(["export", "--model", str(model), "--out", str(tmp_path / "o"), *FP8_EXPORT]) == 2  # before: exit 3
    one_line(capsys, "CheckpointError", "loop.safetensors", "Too many levels of symbolic links")
    assert main(["plan", "--model", str(model)]) == 2
    one_line(capsys, "CheckpointError", "loop.safetensors")
