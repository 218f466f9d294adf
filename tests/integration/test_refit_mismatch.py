"""What the engine serves after a refit, against independent references: the trainer's own
weights (BF16, bit for bit), the codecs' fake-quantization (quantized, bit for bit), transformers'
Qwen3 models (the forward), and the precision ordering of the mismatch."""

from __future__ import annotations

import pytest
import torch

from adapters.reference.config import MICRO_MOE
from adapters.reference.engine import ReferenceEngine
from adapters.reference.model import forward_logits, slot_table
from adapters.reference.trainer import ReferenceTrainer
from app.services.mismatch_probe import MismatchProbe, response_mask, token_batch
from domain.quant.codecs import fake_quantize_weight, nvfp4_global_scale
from domain.quant.formats import NVFP4
from domain.quant.plan import QuantizationPlan
from domain.quant.stream import quantize_stream
from tests import refit_support as rs
from tests.refit_support import one_thread  # noqa: F401  (autouse fixture)

PLANS = {
    "FP8_BLOCK/NVFP4": rs.DEFAULT_PLAN,
    "MXFP8": QuantizationPlan.from_presets("MXFP8", "MXFP8"),
    "MXFP4/NVFP4": QuantizationPlan.from_presets("MXFP4", "NVFP4"),
    "NVFP4/FP8_BLOCK": QuantizationPlan.from_presets("NVFP4", "FP8_BLOCK"),
}


def _refitted(plan: QuantizationPlan, cfg=MICRO_MOE, seed: int = 0):
    t = ReferenceTrainer.from_seed(cfg, seed)
    engine = ReferenceEngine(cfg, plan)
    rs.full_refit(engine, rs.buckets(list(quantize_stream(plan, t.named_weights()))))
    return t, engine


def test_bf16_refit_is_bit_identical_in_weights_and_log_probs():
    t, engine = _refitted(QuantizationPlan.bf16())
    eff = engine.effective_weights()
    assert eff.keys() == t.weights.keys()
    for key, w in t.weights.items():
        assert eff[key].dtype == w.dtype and torch.equal(eff[key].view(torch.int16), w.view(torch.int16)), key
    ids = rs.token_ids()
    assert torch.equal(engine.log_probs(ids)[0], t.log_probs(ids)[0])
    assert MismatchProbe(t, engine).probe(ids).metrics.k3_kl == 0.0


def _expected_effective(t: ReferenceTrainer, plan: QuantizationPlan) -> dict[str, torch.Tensor]:
    """The fused weights the rollout should compute with, from the codecs' fake-quantization of
    each Hugging Face tensor (NVFP4 groups share the group's global scale)."""
    expected = {k: v.clone() for k, v in t.weights.items()}
    members: dict[tuple[str, int | None], list[tuple[str, torch.Tensor]]] = {}
    hf = dict(t.named_weights())
    for module, slot in slot_table(t.config).items():
        members.setdefault((slot.key, slot.expert), []).append((module, hf[f"{module}.weight"]))
    for (key, expert), items in members.items():
        module0, w0 = items[0]
        fmt = plan.decide(f"{module0}.weight", tuple(w0.shape)).format
        if not fmt.is_quantized:
            continue
        gs = nvfp4_global_scale(*(w for _, w in items), numerics=plan.numerics) if fmt == NVFP4 else None
        for module, w in items:
            slot = slot_table(t.config)[module]
            target = expected[key] if expert is None else expected[key][expert]
            target[slot.rows] = fake_quantize_weight(fmt, w, global_scale=gs, numerics=plan.numerics,
                                                     scale_rule=plan.scale_rule)
    return expected


@pytest.mark.parametrize("label", list(PLANS))
def test_quantized_refit_serves_exactly_the_fake_quantized_weights(label):
    plan = PLANS[label]
    t, engine = _refitted(plan)
    eff = engine.effective_weights()
    for key, w in _expected_effective(t, plan).items():
        assert torch.equal(eff[key].view(torch.int16), w.view(torch.int16)), key


def test_activation_quantization_is_applied_on_the_rollout_side():
    # Same weights on both sides (the engine's dequantized ones): only activations differ.
    t, engine = _refitted(rs.DEFAULT_PLAN)
    ids = rs.token_ids()
    weight_only = forward_logits(t.config, engine.effective_weights(), ids)
    served = forward_logits(t.config, engine.effective_weights(), ids, engine._act)
    assert not torch.equal(weight_only, served)
    assert (weight_only - served).abs().max() < 1.0


def test_mismatch_orders_presets_by_element_precision():
    cfg, ids = MICRO_MOE, token_batch(MICRO_MOE.vocab_size, 4, 48, seed=3)
    mask = response_mask(4, 48, 8)
    k3 = {}
    for name in ("BF16", "FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4"):
        plan = QuantizationPlan.from_presets(None if name == "BF16" else name, None if name == "BF16" else name)
        t, engine = _refitted(plan, cfg)
        k3[name] = MismatchProbe(t, engine).probe(ids, mask).metrics.k3_kl
    assert k3["BF16"] == 0.0
    eight_bit = max(k3["FP8_BLOCK"], k3["MXFP8"])
    four_bit = min(k3["MXFP4"], k3["NVFP4"])
    assert 0 < eight_bit < four_bit, k3
    assert k3["NVFP4"] < k3["MXFP4"], k3  # finer blocks and E4M3 scales beat 1x32 power-of-two scales
