"""Whatever a user feeds `refit`, it ends in a clean success or one line with exit status 2.

Hypothesis generates configuration dictionaries (as YAML files), command-line overrides, ignore
patterns (with the shapes that make a backtracking regex engine take exponential time), the
config.json of a `--model DIR` (for `refit demo` and `refit bench engine`), safetensors files with
arbitrary headers and headers that lie about a valid file's dtypes, shapes and offsets
(overlapping, out of bounds, truncated), and index files, and runs `refit plan`, `refit export`
and the others on them through `app.cli.main.main` in this process: the exit status must be 0 or 2, an error
must be one line on stderr with no traceback and no "internal error", and every input must be
done within 60 s (the examples' deadline: a ceiling no load reaches, which a model built for ever
still exceeds). Example counts keep the file within about a minute on
two cores.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import adapters.compressed_tensors.quantization_config  # noqa: F401  (imported once, outside the deadlines)
from app.cli.main import main
from app.config import SCHEMA

# A generous ceiling per input, far above what one takes (a refusal reads headers only), that no
# load reaches: what it catches is an input that builds a model for ever.
DEADLINE = datetime.timedelta(seconds=60)
_settings = settings(max_examples=200, deadline=DEADLINE, derandomize=True,
                     suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
PATHS = [k.path for k in SCHEMA]
SECTIONS = sorted({p.rsplit(".", i)[0] for p in PATHS for i in (1, 2, 3) if p.count(".") >= i})

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=True), st.text(max_size=20),
                    st.sampled_from(["FP8_BLOCK", "NVFP4", "mxfp8", "vllm", "sglang", "re:(", "re:.*", "[a", "{x", "null"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                      max_leaves=12)
keys = st.one_of(st.sampled_from(PATHS), st.sampled_from(SECTIONS), st.text(min_size=1, max_size=30))


def _run(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc in (0, 2), (argv, rc, err)
    assert "Traceback" not in err and "internal error" not in err, (argv, err)
    if rc == 2:
        assert len(err.strip().splitlines()) == 1, err  # one line per error, nothing before it


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, last = path.split(".")
        for part in parents:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                break
            node = nxt
        else:
            node[last] = value
    return tree


@_settings
@given(flat=st.dictionaries(keys, values, max_size=6))
def test_configuration_files(flat: dict[str, Any], capsys: pytest.CaptureFixture) -> None:
    with tempfile.TemporaryDirectory() as d:
        file = Path(d) / "config.yaml"
        try:
            file.write_text(yaml.safe_dump(_nest(flat)))
        except (yaml.YAMLError, ValueError):  # a float yaml cannot write back, e.g.
            return
        _run(["plan", "--json", str(file)], capsys)


@_settings
@given(tree=st.one_of(values, st.dictionaries(keys, values, max_size=6).map(_nest),
                      st.builds(lambda: {"rollout": {"name": {1, 2}}}), st.builds(lambda: {"rollout": object()})))
def test_configuration_dictionaries(tree: Any) -> None:
    from app.config import load_config
    from domain.errors import RefitError

    with contextlib.suppress(RefitError):  # a typed error: the CLI prints it on one line and exits 2
        load_config(tree if isinstance(tree, dict) else {"rollout": tree})


@_settings
@given(key=keys, raw=st.one_of(st.text(max_size=60), values.map(lambda v: json.dumps(v, default=str))))
def test_command_line_overrides(key: str, raw: str, capsys: pytest.CaptureFixture) -> None:
    _run(["plan", "--json", f"{key}={raw}"], capsys)


def _header_bytes(header: object) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


entries = st.fixed_dictionaries({
    "dtype": st.sampled_from(["BF16", "F32", "U8", "F8_E4M3", "I64", "Q9", "F4"]),
    "shape": st.lists(st.integers(min_value=-2, max_value=70), max_size=3),
    "data_offsets": st.lists(st.integers(min_value=-10, max_value=20000), min_size=0, max_size=3),
})
headers = st.one_of(
    st.dictionaries(st.sampled_from(["model.layers.0.mlp.down_proj.weight", "lm_head.weight", "__metadata__", "x"]),
                    entries, max_size=3),
    values,
)


@_settings
@given(header=headers, data=st.binary(max_size=4096), length=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_safetensors_headers(header: object, data: bytes, length: int | None, capsys: pytest.CaptureFixture) -> None:
    raw = _header_bytes(header)
    if length is not None:
        raw = struct.pack("<Q", length) + raw[8:]
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "model.safetensors").write_bytes(raw + data)
        (Path(d) / "config.json").write_text("{}")
        _run(["plan", "--json", "--model", d, "rollout.quantization.linear=MXFP8"], capsys)


@_settings
@given(index=st.one_of(values, st.fixed_dictionaries({"weight_map": st.dictionaries(
    st.sampled_from(["a.weight", "b.weight", "c"]),
    st.one_of(st.sampled_from(["model.safetensors", "../x.safetensors", "/etc/passwd", "missing.safetensors", ""]),
              values), max_size=3)})))
def test_index_files(index: object, capsys: pytest.CaptureFixture) -> None:
    with tempfile.TemporaryDirectory() as d:
        save_file({"a.weight": torch.zeros(32, 32, dtype=torch.bfloat16), "b.weight": torch.zeros(32, 32)},
                  str(Path(d) / "model.safetensors"))
        (Path(d) / "model.safetensors.index.json").write_text(json.dumps(index))
        _run(["plan", "--json", "--model", d], capsys)


QC_KEYS = ["quant_method", "config_groups", "weight_block_size", "ignore", "ignored_layers", "modules_to_not_convert",
           "format", "targets", "weights", "input_activations", "num_bits", "type", "strategy", "group_size",
           "block_structure", "dynamic", "symmetric", "kv_cache_scheme", "scale_dtype"]
qc_values = st.recursive(
    st.one_of(scalars, st.sampled_from(["compressed-tensors", "fp8", "mxfp8", "mxfp4", "float", "int", "tensor_group",
                                        "block", "group", "channel", "nvfp4-pack-quantized", "Linear", [128, 128], 4, 8])),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(QC_KEYS), inner, max_size=5),
    max_leaves=16,
)


def _maybe(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(strategy, qc_values)


quant_args = st.dictionaries(st.sampled_from(["num_bits", "type", "strategy", "group_size", "block_structure", "dynamic",
                                              "symmetric", "scale_dtype"]),
                             _maybe(st.sampled_from([4, 8, 16, 32, "float", "int", "block", "group", "tensor_group",
                                                     "channel", "tensor", "token", [128, 128], [1, 32], True, False])),
                             max_size=8)
groups = st.fixed_dictionaries({"targets": _maybe(st.lists(st.sampled_from(["Linear", "re:.*mlp.experts.*", 5]), max_size=2)),
                                "weights": _maybe(quant_args)},
                               optional={"input_activations": _maybe(quant_args), "format": qc_values})
quantization_configs = st.one_of(
    st.dictionaries(st.sampled_from(QC_KEYS), qc_values, max_size=5),
    st.fixed_dictionaries({"quant_method": _maybe(st.sampled_from(["compressed-tensors", "fp8", "mxfp8"])),
                           "config_groups": _maybe(st.dictionaries(st.text(max_size=5), groups, max_size=3))},
                          optional={"format": qc_values, "ignore": qc_values, "weight_block_size": qc_values,
                                    "kv_cache_scheme": _maybe(quant_args)}),
)


@_settings
@given(qc=quantization_configs)
def test_quantization_config_dictionaries(qc: dict[str, Any], capsys: pytest.CaptureFixture) -> None:
    tree = {"rollout": {"name": "vllm", "engine_kwargs": {"vllm": {"hf_overrides": {"quantization_config": qc}}}}}
    with tempfile.TemporaryDirectory() as d:
        file = Path(d) / "config.yaml"
        try:
            file.write_text(yaml.safe_dump(tree))
        except (yaml.YAMLError, ValueError):
            return
        _run(["plan", "--json", str(file)], capsys)


# --- ignore patterns ----------------------------------------------------------------------------

ATOMS = st.sampled_from([".", "a", "\\.", "[a.]", "[0-9]", "\\w", "layers", "(", ")", "[", "\\", "*"])
QUANTIFIERS = st.sampled_from(["", "*", "+", "?", "{0,3}", "*?", "++", "{2}"])


def _regex(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.one_of(
        st.tuples(inner, inner).map("".join),
        st.tuples(inner, QUANTIFIERS).map(lambda t: f"({t[0]}){t[1]}"),
        st.tuples(inner, inner, QUANTIFIERS).map(lambda t: f"({t[0]}|{t[1]}){t[2]}"),
        inner.map(lambda r: f"(?>{r})"),
    )


regexes = st.recursive(st.tuples(ATOMS, QUANTIFIERS).map("".join), _regex, max_leaves=10)
patterns = st.one_of(
    regexes.map(lambda r: f"re:{r}"), regexes.map(lambda r: f"re:{r}Z"),
    st.sampled_from(["re:(.|.)*Z", "re:(a+)+$", "re:.*.*.*.*.*Z", "re:(", "re:" + "(" * 200 + ")" * 200,
                     "*mlp.gate", "*" * 30 + "Z", "[", "lm_head", ""]),
    st.text(max_size=30),
)
# Names on which backtracking is worst: long runs of what the patterns' atoms match.
LONG = "model.layers.0." + "a" * 120 + ".weight"


@pytest.fixture(scope="module")
def long_names(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("long-names")
    save_file({LONG: torch.zeros(32, 32, dtype=torch.bfloat16),
               "model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 32, dtype=torch.bfloat16),
               "model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(32, 32, dtype=torch.bfloat16),
               "model." + "a." * 60 + "weight": torch.zeros(32, 32, dtype=torch.bfloat16)},
              str(d / "model.safetensors"))
    (d / "config.json").write_text("{}")
    return d


FP8_GROUP = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                                "block_structure": [128, 128], "symmetric": True, "dynamic": False}}


@settings(_settings, max_examples=500)
@given(entries=st.lists(patterns, min_size=1, max_size=3), where=st.sampled_from(["ignore", "qat", "config_file"]))
def test_ignore_patterns(entries: list[str], where: str, long_names: Path, capsys: pytest.CaptureFixture) -> None:
    with tempfile.TemporaryDirectory() as d:
        if where == "config_file":
            qc = {"quant_method": "compressed-tensors", "config_groups": {"group_0": FP8_GROUP}, "ignore": entries}
            (Path(d) / "qc.json").write_text(json.dumps(qc))
            tree: dict[str, Any] = {"rollout": {"quantization": {"config_file": str(Path(d) / "qc.json")}}}
        elif where == "qat":
            tree = {"rollout": {"quantization": {"linear": "FP8_BLOCK"}},
                    "actor": {"megatron": {"qat": {"enable": True, "mode": "FP8_BLOCK", "ignore_patterns": entries}}}}
        else:
            tree = {"rollout": {"quantization": {"linear": "FP8_BLOCK", "ignore": entries}}}
        (Path(d) / "c.yaml").write_text(yaml.safe_dump(tree))
        _run(["plan", "--json", "--model", str(long_names), str(Path(d) / "c.yaml")], capsys)


# --- safetensors headers that lie about a valid file ---------------------------------------------

VALID = {"model.layers.0.self_attn.q_proj.weight": (torch.bfloat16, (64, 64)),
         "model.layers.0.mlp.down_proj.weight": (torch.bfloat16, (64, 64)), "model.norm.weight": (torch.float32, (64,))}
LIES = st.sampled_from(["dtype", "shape", "offsets", "overlap", "gap", "truncate", "header_length", "extra_bytes"])


def _valid_file() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        save_file({n: torch.ones(shape, dtype=dtype) for n, (dtype, shape) in VALID.items()}, str(Path(d) / "m.safetensors"))
        return (Path(d) / "m.safetensors").read_bytes()


def _lie(raw: bytes, lie: str, data: st.DataObject) -> bytes:
    n = struct.unpack("<Q", raw[:8])[0]
    header, body = json.loads(raw[8:8 + n]), raw[8 + n:]
    names = [k for k in header if k != "__metadata__"]
    name = data.draw(st.sampled_from(names))
    entry = header[name]
    if lie == "dtype":
        entry["dtype"] = data.draw(st.sampled_from(["F32", "F16", "U8", "I64", "F8_E4M3", "BOOL", "F64"]))
    elif lie == "shape":
        entry["shape"] = data.draw(st.lists(st.integers(0, 200), max_size=4))
    elif lie == "offsets":
        entry["data_offsets"] = data.draw(st.lists(st.integers(-5, len(body) + 64), min_size=2, max_size=2))
    elif lie == "overlap":
        other = header[data.draw(st.sampled_from([k for k in names if k != name]))]
        entry["data_offsets"] = list(other["data_offsets"])
    elif lie == "gap":
        start, end = entry["data_offsets"]
        shift = data.draw(st.integers(1, 64))
        entry["data_offsets"] = [start + shift, end + shift]
    elif lie == "truncate":
        return raw[:data.draw(st.integers(0, len(raw) - 1))]
    out = json.dumps(header).encode()
    length = len(out) if lie != "header_length" else data.draw(st.integers(0, len(out) + 100).filter(lambda x: x != len(out)))
    tail = body + (b"\0" * data.draw(st.integers(1, 64)) if lie == "extra_bytes" else b"")
    return struct.pack("<Q", length) + out + tail


@settings(_settings, max_examples=500)
@given(lie=LIES, command=st.sampled_from(["plan", "export"]), data=st.data())
def test_lying_safetensors_headers(lie: str, command: str, data: st.DataObject, capsys: pytest.CaptureFixture) -> None:
    with tempfile.TemporaryDirectory() as d:
        model = Path(d) / "m"
        model.mkdir()
        (model / "model.safetensors").write_bytes(_lie(_valid_file(), lie, data))
        (model / "config.json").write_text("{}")
        extra = ["--out", str(Path(d) / "out")] if command == "export" else ["--json"]
        _run([command, "--model", str(model), *extra, "rollout.quantization.linear=FP8_BLOCK"], capsys)


# --- config.json of `refit demo --model DIR` and `refit bench engine --model DIR` ------------------

_CONFIG_KEYS = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
                "attention_bias", "use_sliding_window", "tie_word_embeddings", "model_type", "num_experts",
                "num_experts_per_tok", "moe_intermediate_size", "mlp_only_layers", "decoder_sparse_step",
                "norm_topk_prob", "text_config"]
config_values = st.one_of(
    values, st.integers(min_value=-3, max_value=600), st.sampled_from([10**9, 10**12, 2**40, 2**63, 0.5, 128.5, "128"]),
    st.fixed_dictionaries({"rope_type": st.sampled_from(["default", "yarn", 1]), "rope_theta": scalars}),
)


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from adapters.reference.config import MICRO_DENSE
    from adapters.reference.hf import write_checkpoint
    from adapters.reference.trainer import ReferenceTrainer

    path = write_checkpoint(MICRO_DENSE, ReferenceTrainer.from_seed(MICRO_DENSE, 0).named_weights(),
                            tmp_path_factory.mktemp("fuzz-config") / "m")
    assert main(["demo", "--model", str(path), "--steps", "0", "--json"]) == 0  # imports and warm-up, outside the deadlines
    return path


@settings(_settings, max_examples=25)
@given(edits=st.dictionaries(st.sampled_from(_CONFIG_KEYS), config_values, min_size=1, max_size=3),
       drop=st.lists(st.sampled_from(_CONFIG_KEYS), max_size=2), command=st.sampled_from(["demo", "bench"]))
def test_config_json_of_a_model_directory(edits: dict[str, Any], drop: list[str], command: str, dense_checkpoint: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    import os
    import sys
    from unittest import mock

    config = json.loads((dense_checkpoint / "config.json").read_text())
    for key in drop:
        config.pop(key, None)
    config.update(edits)
    with tempfile.TemporaryDirectory() as d:
        model = Path(d) / "m"
        model.mkdir()
        os.link(dense_checkpoint / "model.safetensors", model / "model.safetensors")
        (model / "config.json").write_text(json.dumps(config))
        # the engine bench checks config.json before it needs vLLM: a valid one ends in "needs vllm" (exit 2),
        # whether or not .venv-vllm exists (its engine host's python is this one, which has no vLLM)
        argv = (["demo", "--model", str(model), "--steps", "0", "--json"] if command == "demo"
                else ["bench", "engine", "--model", str(model), "--deployment", "disaggregated"])
        with mock.patch.dict(os.environ, {"RL_REFIT_VLLM_PYTHON": sys.executable}):
            _run(argv, capsys)
    capsys.readouterr()
