"""`refit export` of tiny Qwen3 / Qwen3-MoE checkpoints under each element rule, every exported
tensor against the rule's reference computed from the BF16 source: vLLM's own quantizers under
`engine` (the default), compressed-tensors' functions under `compressed-tensors`. The exported
config records the rule, and compressed-tensors and vLLM read that config without complaint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (.venv-vllm), which `make test` creates")
pytest.importorskip("transformers", reason="building the tiny HF models needs transformers")

import torch
from safetensors.torch import load_file

from adapters.engine_quantization import NUMERICS_KEY
from adapters.hf_checkpoint.reader import HfCheckpoint
from app.config import build_config
from app.services.checkpoint_export import export_checkpoint
from app.services.planning import make_plan
from domain.quant import naming
from domain.quant.formats import NVFP4, ElementRule
from tests.codecs import ct_reference
from tests.integration.export_models import save_tiny_model
from tests.vllm import references as ref
from tests.vllm.compare import assert_equals_vllm, bits

COMBOS = [("FP8_BLOCK", "NVFP4"), ("MXFP8", "MXFP4"), ("NVFP4", "FP8_BLOCK"), ("MXFP4", "MXFP8")]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("qwen3moe"), moe=True, layers=1)


def _export(src: Path, out: Path, linear: str, moe: str, numerics: str | None) -> tuple[dict, dict, object]:
    overrides = [f"rollout.quantization.linear={linear}", f"rollout.quantization.moe={moe}", "rollout.name=vllm"]
    # vLLM serves NVFP4 weight-only (docs/support-matrix.md); the weights are the same either way
    overrides += [f"rollout.quantization.{role}_activation=none" for role, fmt in (("linear", linear), ("moe", moe))
                  if fmt == NVFP4.name]
    if numerics is not None:
        overrides.append(f"rollout.quantization.numerics={numerics}")
    checkpoint = HfCheckpoint(src)
    report = make_plan(build_config({}, overrides), checkpoint)
    export_checkpoint(checkpoint, out, report)
    return json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors"), report


def _group_sources(original: dict[str, torch.Tensor], group: str | None, module: str) -> list[torch.Tensor]:
    members = naming.group_members(group) if group else (module,)
    return [original[m + ".weight"] for m in members]


@pytest.mark.parametrize(("linear", "moe"), COMBOS, ids=[f"{a}-{b}" for a, b in COMBOS])
@pytest.mark.parametrize("numerics", [None, "compressed-tensors"], ids=["default", "compressed-tensors"])
def test_export_equals_the_rules_reference(moe_dir: Path, tmp_path: Path, linear: str, moe: str,
                                           numerics: str | None) -> None:
    config, exported, report = _export(moe_dir, tmp_path / "out", linear, moe, numerics)
    plan = report.plan  # type: ignore[attr-defined]
    assert plan.numerics is (ElementRule.ENGINE if numerics is None else ElementRule.COMPRESSED_TENSORS)
    original = load_file(moe_dir / "model.safetensors")
    checked = 0
    for name, w in original.items():
        d = plan.decide(name, tuple(w.shape))
        if not d.is_quantized:
            continue
        module = naming.module_name(name)
        tensors = {t: exported[f"{module}.{t}"] for t in d.format.tensor_names}
        group = _group_sources(original, d.group, module) if d.format.name == NVFP4.name else []
        if plan.numerics is ElementRule.ENGINE:
            gs = ref.nvfp4_global_scale(*group) if group else None
            assert_equals_vllm(d.format, tensors, w, gs, name)
        else:
            gs = ct_reference.global_scale(*group) if group else None
            for key, want in ct_reference.quantize(d.format, w, gs).items():
                got = tensors[key].reshape(want.shape).to(want.dtype) if key == "weight_global_scale" else tensors[key]
                assert torch.equal(bits(got), bits(want)), (name, key)
        checked += 1
    assert checked == 4 + 12  # q/k/v/o and 4 experts x gate/up/down
    recorded = config["quantization_config"][NUMERICS_KEY]
    assert recorded["element_rule"] == plan.numerics.value
    assert set(recorded["formats"]) >= {linear, moe}


def test_loaders_ignore_the_recorded_rule(moe_dir: Path, tmp_path: Path) -> None:
    from compressed_tensors.quantization import QuantizationConfig
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    config, _, _ = _export(moe_dir, tmp_path / "out", "FP8_BLOCK", "NVFP4", None)
    qc = config["quantization_config"]
    assert NUMERICS_KEY in qc
    without = {k: v for k, v in qc.items() if k != NUMERICS_KEY}
    parsed = QuantizationConfig.model_validate(qc)
    assert parsed == QuantizationConfig.model_validate(without)
    vllm_config = CompressedTensorsConfig.from_config(qc)
    assert vllm_config.target_scheme_map == CompressedTensorsConfig.from_config(without).target_scheme_map
