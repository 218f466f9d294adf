"""domain.quant.modelopt_layout: NVFP4 experts in ModelOpt's checkpoint layout (the names, the
decode scale, the config vLLM reads). Against vLLM's own quantizer: tests/vllm/test_modelopt_nvfp4.py."""

from __future__ import annotations

import pytest
import torch

from domain.quant import modelopt_layout as mo
from domain.quant.codecs import nvfp4_global_scale, quantize_weight
from domain.quant.formats import NVFP4


def test_tensors_keep_the_codes_and_store_the_decode_scale() -> None:
    w = torch.randn(32, 64).to(torch.bfloat16)
    ct = quantize_weight(NVFP4, w, global_scale=nvfp4_global_scale(w)).tensors
    out = mo.modelopt_tensors(ct)
    assert set(out) == {"weight", "weight_scale", "weight_scale_2"}
    assert out["weight"] is ct["weight_packed"] and out["weight_scale"] is ct["weight_scale"]
    assert out["weight_scale_2"].shape == () and out["weight_scale_2"].dtype == torch.float32
    # python_float / tensor is tensor.reciprocal() * python_float, as vLLM writes it
    assert torch.equal(out["weight_scale_2"], ct["weight_global_scale"].reshape(()).reciprocal())


def test_a_projection_without_its_global_scale_is_refused() -> None:
    with pytest.raises(KeyError, match="weight_global_scale"):
        mo.modelopt_tensors({"weight_packed": torch.zeros(1), "weight_scale": torch.zeros(1)})


def test_names() -> None:
    assert mo.rename("model.layers.1.mlp.experts.3.up_proj.weight_packed") == "model.layers.1.mlp.experts.3.up_proj.weight"
    assert mo.rename("model.layers.1.mlp.experts.3.up_proj.weight_global_scale") == (
        "model.layers.1.mlp.experts.3.up_proj.weight_scale_2")
    assert mo.rename("model.layers.1.mlp.experts.3.up_proj.weight_scale") == "model.layers.1.mlp.experts.3.up_proj.weight_scale"
    assert mo.rename("model.norm.weight") == "model.norm.weight"


def test_config_is_modelopts_nvfp4_with_the_bf16_modules_excluded() -> None:
    qc = mo.quantization_config(["lm_head", "model.layers.0.self_attn.q_proj", "lm_head"])
    assert qc == {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                  "ignore": ["lm_head", "model.layers.0.self_attn.q_proj"], "kv_cache_scheme": None}
    assert mo.PER_TOKEN_OVERRIDE == {"moe": {"activation": "nvfp4_per_token"}}
