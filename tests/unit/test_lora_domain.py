"""The LoRA adapter value: validation naming the module, PEFT's scaling, the merged stream's checks."""

from __future__ import annotations

import math

import pytest
import torch

from domain.errors import RefitError
from domain.lora import (
    LoraAdapter,
    LoraNonFinite,
    LoraRankMismatch,
    LoraShapeMismatch,
    LoraUnknownTarget,
    LoraWeights,
    delta_weight,
    merge_weight,
    merged_stream,
    pack,
)

Q = "model.layers.0.self_attn.q_proj"


def _w(r: int = 4, n: int = 6, k: int = 8, dtype: torch.dtype = torch.float32) -> LoraWeights:
    g = torch.Generator().manual_seed(0)
    return LoraWeights(torch.randn(r, k, generator=g).to(dtype), torch.randn(n, r, generator=g).to(dtype))


def _adapter(**kw: object) -> LoraAdapter:
    args: dict[str, object] = {"r": 4, "lora_alpha": 8.0, "target_modules": ("q_proj",), "modules": {Q: _w()}}
    args.update(kw)
    return LoraAdapter(**args)  # type: ignore[arg-type]


def test_scaling_is_peft_s() -> None:
    assert _adapter().scaling == 2.0
    assert _adapter(use_rslora=True).scaling == 8.0 / math.sqrt(4)


def test_rank_mismatch_names_the_module() -> None:
    with pytest.raises(LoraRankMismatch, match=r"q_proj.*rank 4/4, the adapter's r is 8") as info:
        _adapter(r=8)
    assert info.value.module == Q and isinstance(info.value, (RefitError, ValueError))


def test_a_and_b_of_different_rank_are_refused() -> None:
    w = LoraWeights(torch.zeros(4, 8), torch.zeros(6, 2))
    with pytest.raises(LoraRankMismatch, match="4/2"):
        _adapter(modules={Q: w})


def test_non_2d_tensors_are_a_shape_mismatch() -> None:
    with pytest.raises(LoraShapeMismatch, match="must be 2-D"):
        _adapter(modules={Q: LoraWeights(torch.zeros(4, 8, 1), torch.zeros(6, 4))})


@pytest.mark.parametrize("which", ["lora_A", "lora_B"])
def test_non_finite_values_are_refused(which: str) -> None:
    w = _w()
    getattr(w, which)[0, 0] = float("nan")
    with pytest.raises(LoraNonFinite, match=f"{which} holds NaN"):
        _adapter(modules={Q: w})


def test_module_outside_target_modules_is_refused() -> None:
    with pytest.raises(LoraUnknownTarget, match="'q_proj' is not in target_modules"):
        _adapter(target_modules=("v_proj",))


def test_check_base_finds_missing_and_misfitting_weights() -> None:
    a = _adapter()
    a.check_base({f"{Q}.weight": (6, 8)})
    with pytest.raises(LoraUnknownTarget, match="no such weight"):
        a.check_base({})
    with pytest.raises(LoraShapeMismatch, match=r"does not fit the base weight \(6, 9\)"):
        a.check_base({f"{Q}.weight": (6, 9)})


def test_from_named_tensors_needs_both_halves_and_peft_names() -> None:
    w = _w()
    with pytest.raises(LoraShapeMismatch, match="lora_B is missing"):
        LoraAdapter.from_named_tensors({f"base_model.model.{Q}.lora_A.weight": w.lora_A}, r=4, lora_alpha=8,
                                       target_modules=["q_proj"])
    with pytest.raises(LoraShapeMismatch, match="not a PEFT LoRA tensor name"):
        LoraAdapter.from_named_tensors({f"{Q}.weight": w.lora_A}, r=4, lora_alpha=8, target_modules=["q_proj"])


def test_delta_and_merge_against_plain_torch() -> None:
    w = _w()
    weight = torch.randn(6, 8)
    assert torch.equal(delta_weight(w, 2.0), (w.lora_B @ w.lora_A) * 2.0)
    merged = merge_weight(Q, weight, w, 2.0)
    assert torch.equal(merged, weight + (w.lora_B @ w.lora_A) * 2.0)
    assert merged.data_ptr() != weight.data_ptr()


def test_bf16_delta_is_computed_in_float32_on_cpu() -> None:
    w = _w(dtype=torch.bfloat16)
    want = ((w.lora_B.float() @ w.lora_A.float()) * 2.0).to(torch.bfloat16)
    assert delta_weight(w, 2.0).dtype == torch.bfloat16 and torch.equal(delta_weight(w, 2.0), want)


def test_merged_stream_checks_shapes_and_missing_modules() -> None:
    a = _adapter()
    with pytest.raises(LoraShapeMismatch, match="q_proj"):
        list(merged_stream([(f"{Q}.weight", torch.zeros(7, 8))], a))
    with pytest.raises(LoraUnknownTarget, match="no weight"):
        list(merged_stream([("model.layers.0.self_attn.k_proj.weight", torch.zeros(6, 8))], a))


def test_pack_leaves_missing_slices_empty() -> None:
    packed = pack(_adapter())
    qkv = packed["model.layers.0.self_attn.qkv_proj"]
    assert qkv.slices == (Q, "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj")
    assert qkv.lora_A[1] is None and qkv.lora_B[2] is None and qkv.lora_A[0] is not None
