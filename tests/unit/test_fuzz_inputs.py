"""Whatever a user feeds `refit`, it ends in a clean success or one line with exit status 2.

Hypothesis generates configuration dictionaries (as YAML files), command-line overrides,
safetensors files with arbitrary headers, and index files, and runs `refit plan` on them through
`app.cli.main.main`: the exit status must be 0 or 2, and stderr must hold no traceback and no
"internal error". Example counts stay modest so that the suite stays fast.
"""

from __future__ import annotations

import contextlib
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

from app.cli.main import main
from app.config import SCHEMA

_settings = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
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
        assert err.strip().count("\n") == 0 or "refit plan:" in err, err  # one line per error


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
