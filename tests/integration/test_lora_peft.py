"""LoRA from a PEFT-wrapped transformers model: the merge is PEFT's own, bit for bit.

The references are PEFT's: `merge_and_unload()` for the merged weights, `save_pretrained` for the
tensor names, and quantizing PEFT's merged model for the merged refit's checkpoint tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adapters.hf.fixtures import FIXTURES
from domain.lora import LoraAdapter, LoraBytes, LoraUnsupported, merged_stream, pack
from domain.quant.plan import QuantizationPlan
from domain.quant.stream import quantize_stream

transformers = pytest.importorskip("transformers", reason="needs transformers (the `hf` extra)")
peft = pytest.importorskip("peft", reason="needs peft (the `hf` extra)")

from adapters.hf.lora import adapter_from_peft, base_weights  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_model(dtype: torch.dtype, *, use_rslora: bool = False, autocast: bool = True, seed: int = 0,
                **lora: object) -> torch.nn.Module:
    model_type, keys = FIXTURES["tiny-qwen3"]
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(model_type, **keys)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, use_rslora=use_rslora, **lora)
    pm = peft.get_peft_model(model, cfg, autocast_adapter_dtype=autocast)
    with torch.no_grad():  # PEFT initializes lora_B to zero: make every delta count
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p, dtype=torch.float32).to(p.dtype) * 0.05)
    return pm


CASES = [  # (base dtype, rslora, PEFT's autocast of the adapter to float32)
    (torch.bfloat16, False, True), (torch.bfloat16, True, True), (torch.bfloat16, False, False),
    (torch.bfloat16, True, False), (torch.float32, False, True), (torch.float32, True, True),
]


def _merged_by_us_and_by_peft(pm: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    adapter = adapter_from_peft(pm)
    base = {n: t.clone() for n, t in base_weights(pm)}  # merge_and_unload merges in place
    ours = dict(merged_stream(base.items(), adapter))
    want = {n: p.detach() for n, p in pm.merge_and_unload().named_parameters()}
    return ours, want


@pytest.mark.parametrize(("dtype", "rslora", "autocast"), CASES)
def test_merge_is_bit_identical_to_peft_merge_and_unload(dtype: torch.dtype, rslora: bool, autocast: bool) -> None:
    pm = _peft_model(dtype, use_rslora=rslora, autocast=autocast)
    ours, want = _merged_by_us_and_by_peft(pm)
    assert list(ours) == list(want)
    changed = 0
    for name, w in want.items():
        assert ours[name].dtype == w.dtype, name
        assert torch.equal(ours[name], w), name
        changed += name.endswith("_proj.weight")
    assert changed == 2 * len(TARGETS)  # every targeted weight of both layers went through the merge


def test_merge_changes_the_targeted_weights() -> None:
    pm = _peft_model(torch.bfloat16)
    base = {n: t.clone() for n, t in base_weights(pm)}
    ours = dict(merged_stream(base.items(), adapter_from_peft(pm)))
    assert not torch.equal(ours["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    assert ours["model.embed_tokens.weight"] is base["model.embed_tokens.weight"]  # untouched: passed through


def test_merged_stream_quantized_fp8_block_equals_quantizing_peft_merged_model() -> None:
    plan = QuantizationPlan.from_presets(linear="FP8_BLOCK")
    ours, want = _merged_by_us_and_by_peft(_peft_model(torch.bfloat16))
    got = dict(quantize_stream(plan, ours.items()))
    ref = dict(quantize_stream(plan, want.items()))
    assert list(got) == list(ref)
    assert any(n.endswith("q_proj.weight_scale") for n in got)
    for name, t in ref.items():
        assert got[name].dtype == t.dtype and torch.equal(_bits(got[name]), _bits(t)), name


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def test_extracted_adapter_round_trips_through_save_pretrained(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    pm = _peft_model(torch.bfloat16, use_rslora=True)
    adapter = adapter_from_peft(pm)
    pm.save_pretrained(str(tmp_path))
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    ours = dict(adapter.named_tensors())
    assert sorted(ours) == sorted(saved)
    assert all(torch.equal(ours[n], saved[n]) for n in saved)
    cfg = peft.LoraConfig.from_pretrained(str(tmp_path))
    back = LoraAdapter.from_named_tensors(saved, r=cfg.r, lora_alpha=cfg.lora_alpha,
                                          target_modules=cfg.target_modules, use_rslora=cfg.use_rslora)
    assert back.scaling == adapter.scaling == 16 / 8 ** 0.5
    assert set(back.modules) == set(adapter.modules)
    assert all(torch.equal(back.modules[m].lora_B, w.lora_B) for m, w in adapter.modules.items())


def test_adapter_names_are_the_base_model_modules_and_fit_it() -> None:
    pm = _peft_model(torch.bfloat16)
    adapter = adapter_from_peft(pm)
    shapes = {n: tuple(t.shape) for n, t in base_weights(pm)}
    assert "model.layers.1.mlp.down_proj" in adapter.modules
    assert not any(".base_layer" in n or "lora" in n for n in shapes)
    counted = LoraBytes.of(adapter, shapes, torch.bfloat16)
    assert counted.adapter == sum(t.numel() * t.element_size() for _, t in adapter.named_tensors())
    assert counted.adapter < counted.merged_targets
    assert counted.within_budget(counted.adapter) and not counted.within_budget(2 * counted.adapter + 1)


def test_packing_groups_qkv_and_gate_up_per_layer() -> None:
    adapter = adapter_from_peft(_peft_model(torch.float32))
    packed = pack(adapter)
    assert sorted(n.rsplit(".", 1)[1] for n in packed if ".layers.0." in n) == [
        "down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    qkv = packed["model.layers.0.self_attn.qkv_proj"]
    assert qkv.lora_A[1] is adapter.modules["model.layers.0.self_attn.k_proj"].lora_A
    b_before = adapter.modules["model.layers.0.self_attn.v_proj"].lora_B.clone()
    scaled = qkv.scaled_lora_B()
    assert torch.equal(scaled[2], b_before * 2.0)  # 16 / 8
    assert torch.equal(adapter.modules["model.layers.0.self_attn.v_proj"].lora_B, b_before)  # never in place


@pytest.mark.parametrize(("lora", "what"), [({"use_dora": True}, "DoRA"), ({"lora_bias": True}, "lora_bias"),
                                            ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
                                            ({"modules_to_save": ["lm_head"]}, "modules_to_save")])
def test_peft_variants_the_refit_does_not_carry_are_refused(lora: dict[str, object], what: str) -> None:
    pm = _peft_model(torch.float32, **lora)
    with pytest.raises(LoraUnsupported, match=what) as info:
        adapter_from_peft(pm)
    assert info.value.module.startswith(("model.layers.0.", "lm_head"))


def test_unknown_adapter_name_is_refused() -> None:
    with pytest.raises(LoraUnsupported, match="'other'"):
        adapter_from_peft(_peft_model(torch.float32), adapter_name="other")
