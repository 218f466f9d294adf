"""A PEFT-wrapped transformers model as the trainer of both LoRA modes (`actor.strategy: hf`,
`bootstrap(model=peft_model)`): the adapter mode sends PEFT's own lora_A / lora_B and the engine
serves exactly PEFT's `merge_and_unload()` weights; the merged mode's stream is that merge."""

from __future__ import annotations

import pytest
import torch

from adapters.hf.fixtures import FIXTURES
from adapters.reference.engine import ReferenceEngine
from adapters.reference.model import slot_table
from app.bootstrap import bootstrap
from app.services.lora_sync import LoraSyncService
from app.services.refit import RefitService
from domain.quant.plan import QuantizationPlan
from tests.refit_support import one_thread  # noqa: F401  (autouse fixture)

transformers = pytest.importorskip("transformers", reason="needs transformers (the `hf` extra)")
peft = pytest.importorskip("peft", reason="needs peft (the `hf` extra)")

from adapters.hf.lora import PeftTrainer  # noqa: E402
from adapters.reference.hf import config_from_hf  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_model() -> torch.nn.Module:
    model_type, keys = FIXTURES["tiny-qwen3"]
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **{**keys, "tie_word_embeddings": False})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    _step(pm, 1)
    return pm


@torch.no_grad()
def _step(pm: torch.nn.Module, seed: int) -> None:
    """An optimizer-like step on the adapter, in place (PEFT starts lora_B at zero)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in pm.named_parameters():
        if "lora_" in name:
            p.add_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))


def _merged(pm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """PEFT's own merge, of a copy (merge_and_unload merges in place)."""
    import copy

    return {n: p.detach() for n, p in copy.deepcopy(pm).merge_and_unload().named_parameters()}


def test_the_adapter_mode_from_a_peft_model_serves_peft_merge_and_unload_exactly():
    pm = _peft_model()
    trainer = PeftTrainer(pm)
    cfg = config_from_hf(pm.config.to_dict(), "tiny-qwen3")
    engine = ReferenceEngine(cfg, QuantizationPlan.bf16())
    svc = LoraSyncService(trainer, engine, RefitService(trainer.base, engine, QuantizationPlan.bf16()))
    slots = slot_table(cfg)
    for step in (1, 2):
        if step > 1:
            _step(pm, step)  # the trainer's optimizer moved the adapter: the next sync reads it anew
        report = svc.sync()
        assert report.live and (report.base is not None) == (step == 1)
        assert report.adapter_bytes == trainer.adapter.nbytes and report.bytes_sent == report.adapter_bytes
        want = _merged(pm)
        eff = engine.effective_weights()
        for module in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj", "model.layers.1.mlp.up_proj"):
            slot = slots[module]
            assert torch.equal(eff[slot.key][slot.rows], want[f"{module}.weight"]), (step, module)


def test_the_composition_root_makes_a_peft_model_a_lora_trainer_for_both_modes():
    pm = _peft_model()
    merged = bootstrap(overrides=["actor.strategy=hf"], model=pm).trainer_model()
    assert isinstance(merged, PeftTrainer)
    want = _merged(pm)
    got = dict(merged.named_weights())
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)  # the merged mode's stream
    assert {n for n, _ in merged.base.named_weights()} == set(want)  # the base: the same names, no LoRA tensors
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))
    with_adapter, base_only = merged.log_probs(ids)[0], merged.base.log_probs(ids)[0]
    assert not torch.equal(with_adapter, base_only)  # the base's forward runs with the adapter disabled
