"""Each defect of "never lose or fake data" (exports, overrides, messages, tracebacks), as it was
reproduced, with the behaviour that replaces it.

`ROWS` is the table of command lines: what the user typed, the exit status and the words of the
one-line error now printed (every typed error exits 2; before, many of these were tracebacks or
silent exits 0). The functions after it check what a table cannot: that nothing was deleted, that
a re-export's config agrees with its tensors, that a partial shard does not parse.
(The transport's defects are in tests/distributed/test_bad_peers.py, the rendezvous bind in
tests/distributed/test_launch_bind.py, kills and races in test_export_crash.py.)
"""

from __future__ import annotations

import builtins
import errno
import json
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from adapters.hf_checkpoint import writer as writer_module
from adapters.system.ownership import DestinationLock
from app.cli.main import main
from domain.quant.codecs import QuantizedWeight, dequantize_weight, quantize_weight
from domain.quant.formats import FP8_BLOCK, MXFP4
from tests.integration.export_models import tiny_checkpoint

EXPORT = ["rollout.quantization.linear=NVFP4", "rollout.quantization.moe=MXFP4"]


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("src") / "model")


def _copy(src: Path, dst: Path, **edit: Callable[[Path], None]) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    for name, change in edit.items():
        change(dst / name.replace("__", "."))
    return dst


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


# id -> (make the command line from (tmp_path, src), exit status, words the stderr line holds)
ROWS: dict[str, tuple[Callable[[Path, Path], list[str]], int, tuple[str, ...]]] = {}


def row(name: str, code: int, *words: str) -> Callable[[Callable[[Path, Path], list[str]]], None]:
    def add(make: Callable[[Path, Path], list[str]]) -> None:
        ROWS[name] = (make, code, words)

    return add


for kind in ("empty", "eight_bytes_short", "header_length_too_large", "header_not_json", "truncated_data",
             "header_a_list", "unknown_dtype", "offsets_beyond_the_file"):
    row(f"8: corrupt safetensors: {kind}", 2, "CheckpointError", "not a readable safetensors file")(
        lambda t, s, kind=kind: ["plan", "--model", str(_copy(s, t / "m", model__safetensors=_corrupt(kind)))])
for name, content, words in (
    ("not JSON", "{oops", ("not valid JSON",)),
    ("a list", "[1, 2]", ("not a safetensors index",)),
    ("weight_map not an object", json.dumps({"weight_map": [1]}), ("not a safetensors index",)),
    ("names a missing file", json.dumps({"weight_map": {"lm_head.weight": "gone.safetensors"}}), ("not in",)),
    ("names a tensor the file lacks", json.dumps({"weight_map": {"nope.weight": "model.safetensors"}}),
     ("not in the file the index names",)),
    ("not UTF-8", b"\xff\xfe{}", ("not UTF-8",)),
):
    row(f"8: malformed index: {name}", 2, "CheckpointError", *words)(
        lambda t, s, c=content: ["plan", "--model", str(_copy(s, t / "m", model__safetensors__index__json=_text(c)))])
row("8: config.json is not an object", 2, "CheckpointError", "config.json must be an object")(
    lambda t, s: ["plan", "--model", str(_copy(s, t / "m", config__json=_text("[1]")))])
row("8: --out . in a non-empty working directory", 2, "OutputNotEmpty", "is not empty")(
    lambda t, s: ["export", "--model", str(s), "--out", ".", *EXPORT])
row("8: a non-UTF-8 configuration file", 2, "ConfigError", "not UTF-8")(
    lambda t, s: ["plan", str(_write(t / "c.yaml", b"rollout:\n  name: \xff\n"))])
row("8: extreme nesting in an override", 2, "ConfigError", "rollout.quantization.ignore")(
    lambda t, s: ["plan", "rollout.quantization.ignore=" + "[" * 5000 + "]" * 5000])
row("8: an over-long integer in an override", 2, "ConfigError", "rollout.checkpoint_engine.update_weights_bucket_megabytes")(
    lambda t, s: ["plan", "rollout.checkpoint_engine.update_weights_bucket_megabytes=" + "9" * 5000])
row("8: refit demo --bucket-mb nan", 2, "argument --bucket-mb", "above 0")(lambda t, s: ["demo", "--bucket-mb", "nan"])
row("8: refit demo --seed 10**30", 2, "argument --seed", "from 0 to")(lambda t, s: ["demo", "--seed", str(10**30)])
row("8: refit demo --plot in a missing directory", 2, "argument --plot", "does not exist")(
    lambda t, s: ["demo", "--plot", str(t / "missing" / "m.png")])
row("8: doctor --environment on a JSON list", 2, "ConfigError", "--environment", "JSON list")(
    lambda t, s: ["doctor", "--environment", str(_write(t / "env.json", b"[1, 2]"))])
row("9: index weight_map paths that leave the model directory", 2, "CheckpointError", "inside the model directory")(
    lambda t, s: ["plan", "--model", str(_copy(s, t / "m", model__safetensors__index__json=_index(
        {"lm_head.weight": "../../other/model.safetensors"})))])
row("9: --shard-size-mb 0", 2, "argument --shard-size-mb", "above 0")(
    lambda t, s: ["export", "--model", str(s), "--out", str(t / "o"), "--shard-size-mb", "0", *EXPORT])
row("9: a source without config.json", 2, "CheckpointError", "has no config.json")(
    lambda t, s: ["export", "--model", str(_copy(s, t / "m", config__json=lambda f: f.unlink())), "--out", str(t / "o"),
                  *EXPORT])
row("9: moe=NVFP4 on a dense model", 2, "ConfigError", "rollout.quantization.moe", "no tensor of this model")(
    lambda t, s: ["plan", "--model", str(_dense(t)), "rollout.quantization.moe=NVFP4"])
row("9: --model names a file", 2, "CheckpointError", "is not a directory")(lambda t, s: ["plan", "--model", "/dev/null"])
row("9: the configuration file is a directory", 2, "ConfigError", "is a directory")(lambda t, s: ["plan", str(t)])
row("9: rollout=5", 2, "ConfigTypeError", "is a section, not a value")(lambda t, s: ["plan", "rollout=5"])
row("9: --plot names a directory", 2, "argument --plot", "is a directory", "mismatch.png")(
    lambda t, s: ["demo", "--plot", str(t)])
row("5: an override that is not valid YAML", 2, "ConfigError", "rollout.quantization.ignore", "not valid YAML",
    "quote it", "rollout.quantization.ignore=[lm_head, 're:.*layers\\.0\\..*']")(
    lambda t, s: ["plan", 'rollout.quantization.ignore=[lm_head, "re:.*layers\\.0\\..*"]'])
row("2: --force with --out the parent of --model", 2, "OutputOverlapsModel", "contains the model directory")(
    lambda t, s: ["export", "--model", str(_copy(s, t / "parent" / "m")), "--out", str(t / "parent"), "--force", *EXPORT])
row("2: --out inside --model", 2, "OutputOverlapsModel", "is inside the model directory")(
    lambda t, s: ["export", "--model", str(_copy(s, t / "m")), "--out", str(t / "m" / "out"), "--force", *EXPORT])
row("2: --out a symlink to --model", 2, "OutputOverlapsModel", "is the model directory")(
    lambda t, s: ["export", "--model", str(_copy(s, t / "m")), "--out", str(_link(t / "link", t / "m")), "--force", *EXPORT])
row("2: a model file symlinked into --out", 2, "OutputOverlapsModel", "resolves to")(
    lambda t, s: ["export", "--model", str(_linked_model(s, t)), "--out", str(t / "blobs"), "--force", *EXPORT])
row("3: a stored layout rl-refit cannot decode", 2, "QuantizedSource", "weight_packed int32")(
    lambda t, s: ["export", "--model", str(_int4_model(t)), "--out", str(t / "o"), *EXPORT])


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _link(link: Path, target: Path) -> Path:
    link.symlink_to(target)
    return link


def _dense(t: Path) -> Path:
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


@pytest.mark.parametrize("name", list(ROWS))
def test_the_table(name: str, src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                   capsys: pytest.CaptureFixture) -> None:
    make, code, words = ROWS[name]
    work = tmp_path / "cwd"
    work.mkdir()
    (work / "keep.txt").write_text("x")
    monkeypatch.chdir(work)
    argv = make(tmp_path, src)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink()}
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err  # one line
    for w in words:
        assert w in err[0], (w, err[0])
    after = {p: p.read_bytes() for p in before if p.exists()}
    assert after == before, "a refused command changed or deleted files"


# --- 1: export deletes data in --out without --force ---------------------------------------------


def test_a_directory_created_in_out_while_exporting_survives(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    real_close = writer_module.CheckpointWriter.close

    def close_while_someone_writes(self: Any) -> None:
        (out / "theirs").mkdir(parents=True)
        (out / "theirs" / "data.bin").write_bytes(b"precious")
        real_close(self)

    monkeypatch.setattr(writer_module.CheckpointWriter, "close", close_while_someone_writes)
    assert main(["export", "--model", str(src), "--out", str(out), *EXPORT]) == 2
    assert "OutputChanged" in capsys.readouterr().err
    assert (out / "theirs" / "data.bin").read_bytes() == b"precious"  # before: deleted, exit 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_empty_out_that_gains_content_is_not_replaced(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    out.mkdir()
    real_close = writer_module.CheckpointWriter.close

    def close_while_someone_writes(self: Any) -> None:
        (out / "late.txt").write_text("mine")
        real_close(self)

    monkeypatch.setattr(writer_module.CheckpointWriter, "close", close_while_someone_writes)
    assert main(["export", "--model", str(src), "--out", str(out), *EXPORT]) == 2
    assert "OutputChanged" in capsys.readouterr().err and (out / "late.txt").read_text() == "mine"


def test_a_second_export_to_the_same_out_is_refused_while_the_first_runs(src: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    with DestinationLock(out):  # what the first export holds while it runs
        assert main(["export", "--model", str(src), "--out", str(out), *EXPORT]) == 2
    assert "OutputBusy" in capsys.readouterr().err and not out.exists()
    assert main(["export", "--model", str(src), "--out", str(out), *EXPORT]) == 0  # the lock died with its holder


# --- 3: a pre-quantized source gets a lying config ----------------------------------------------


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


# --- 8: read-only output, full disk ---------------------------------------------------------------


@pytest.mark.parametrize(("code", "fix"), [(errno.EROFS, "read-only"), (errno.EACCES, "no permission"),
                                          (errno.ENOSPC, "free some space")])
def test_an_output_that_cannot_be_written(code: int, fix: str, src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture) -> None:
    def refuse(*_a: Any, **_k: Any) -> Any:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(writer_module, "open", refuse, raising=False)
    assert main(["export", "--model", str(src), "--out", str(tmp_path / "out"), *EXPORT]) == 2
    err = capsys.readouterr().err
    assert "OutputNotWritable" in err and fix in err and os.strerror(code) in err
    assert list(tmp_path.iterdir()) == []


def test_a_zero_size_weight_with_nvfp4(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    d = tmp_path / "m"
    d.mkdir()
    save_file({"model.layers.0.mlp.down_proj.weight": torch.zeros(0, 64, dtype=torch.bfloat16)}, d / "model.safetensors")
    (d / "config.json").write_text("{}")
    assert main(["export", "--model", str(d), "--out", str(tmp_path / "o"), "rollout.quantization.linear=NVFP4"]) == 2
    assert "UnsupportedShape" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_out_dot_in_an_empty_directory(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "here"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["export", "--model", str(src), "--out", ".", *EXPORT]) == 0
    assert (tmp_path / "here" / "config.json").is_file()


# --- 9: smaller silent or misleading results ------------------------------------------------------


def test_a_shard_cut_short_does_not_parse(tmp_path: Path) -> None:
    from domain.quant.stream import TensorSpec

    specs = [TensorSpec(f"t{i}", torch.bfloat16, (64, 64)) for i in range(4)]
    w = writer_module.CheckpointWriter(tmp_path, specs)
    w.write("t0", torch.ones(64, 64, dtype=torch.bfloat16))  # killed here: the other tensors are zeros
    w.abort()
    with pytest.raises(SafetensorError), safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        list(f.keys())  # before: it parsed, with t1..t3 all zeros


def test_shards_and_directories_are_fsynced_before_the_rename(src: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else "?")
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    out = tmp_path / "out"
    assert main(["export", "--model", str(src), "--out", str(out), "--shard-size-mb", "0.01", *EXPORT]) == 0
    partial = next(p for p in synced if re.fullmatch(rf"{re.escape(str(tmp_path))}/\.out\.partial-[0-9a-f]{{32}}", p))
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    for name in [*shards, "model.safetensors.index.json", "config.json", "tokenizer_config.json"]:
        assert f"{partial}/{name}" in synced, name
    assert synced.index(partial) > max(synced.index(f"{partial}/{n}") for n in shards)  # the directory after its files
    assert synced[-1] == str(tmp_path)  # the rename itself


@pytest.mark.parametrize("name", ["lm_head.weight", "model.norm.weight"])
def test_nan_in_a_tensor_kept_bf16_is_refused(name: str, src: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    def poison(f: Path) -> None:
        t = load_file(f)
        t[name] = t[name].clone()
        t[name].view(-1)[3] = float("nan")
        save_file(t, f)

    m = _copy(src, tmp_path / "m", model__safetensors=poison)
    assert main(["export", "--model", str(m), "--out", str(tmp_path / "o"), *EXPORT]) == 2
    err = capsys.readouterr().err
    assert "NonFiniteTensor" in err and name in err and not (tmp_path / "o").exists()


def test_the_plan_table_shows_lists_and_regexes(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "rollout.quantization.linear=FP8_BLOCK",
                 "rollout.quantization.ignore=[lm_head, 're:.*layers\\.[0-3]\\..*']"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "['lm_head', 're:.*layers\\.[0-3]\\..*']" in out  # before: rich swallowed [...] as markup


def test_the_docs_ignore_example_keeps_layer_0_in_bf16(src: Path, capsys: pytest.CaptureFixture) -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    example = next(line for line in docs.splitlines() if "rollout.quantization.ignore=" in line and "refit plan" in line)
    override = example.split('"')[1]  # the documented override, as the shell passes it
    assert main(["plan", "--json", "--model", str(src), "rollout.quantization.linear=FP8_BLOCK", override]) == 0
    formats = {t["name"]: t["format"] for t in json.loads(capsys.readouterr().out)["tensors"]}
    assert formats["model.layers.0.self_attn.q_proj.weight"] == "BF16"
    assert formats["model.layers.1.self_attn.q_proj.weight"] == "FP8_BLOCK"


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


def test_builtins_open_is_untouched() -> None:
    assert writer_module.__dict__.get("open", builtins.open) is builtins.open  # the patches above were undone
