"""QAT numerics: the reference backend trains on dequantize(exported tensors), bit for bit.

The reference values come from the exporter's checkpoint tensors (quantize_stream) decoded with
the codec (tests/unit/qat_models.rollout_values), for every preset, both element rules, both MX
scale rules, dense layers, q/k/v and gate/up groups spread over separate modules, and fused 3-D
experts; the inputs get the rollout's activation quantization under the plan's rule.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adapters.qat_reference.backend import ReferenceQatBackend
from domain.quant.codecs import fake_quantize_activation
from domain.quant.formats import ActivationScheme
from domain.quant.plan import QuantizationPlan
from domain.quant.qat import HfPart, TrainerTensor, fake_quantize_tensors, straight_through
from tests.unit.qat_models import H, LinearCalls, TinyHf, rollout_values

PRESETS = ["FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4"]
CASES = ([(p, None, n) for p in PRESETS for n in ("engine", "compressed-tensors")]
         + [("MXFP8", "even", "engine"), ("MXFP4", "rceil", "engine")])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    diff = int((_bits(got) != _bits(want)).sum())
    assert diff == 0, f"{what}: {diff} of {got.numel()} elements differ"


@pytest.mark.parametrize(("preset", "rule", "numerics"), CASES)
def test_weights_equal_decoded_export_for_every_layer_kind(preset: str, rule: str | None, numerics: str) -> None:
    model = TinyHf()
    plan = QuantizationPlan.from_presets(preset, preset, scale_rule=rule, numerics=numerics)
    want = rollout_values(plan, [(n, p.detach()) for n, p in model.named_parameters()])
    summary = ReferenceQatBackend().apply(model, plan)
    model(torch.randn(5, H, dtype=torch.bfloat16))

    checked = 0
    for name, module in model.named_modules():
        seen = getattr(module, "seen_weight", None)
        if seen is None:
            continue
        for param, value in (seen.items() if isinstance(seen, dict) else [("weight", seen)]):
            full = f"{name}.{param}"
            _assert_bitwise(value, want[full], full)
            checked += 1
    assert checked == 15  # q, k, v, o, gate, up, down; q, k, v, o; router; 2 expert tensors; lm_head
    quantized = {p.name for p in summary.quantized}
    assert "model.layers.1.mlp.experts.gate_up_proj" in quantized
    assert "lm_head.weight" not in quantized and "model.layers.1.mlp.gate.weight" not in quantized


def test_fused_group_shares_the_exporters_global_scale() -> None:
    # k_proj alone would get another NVFP4 global scale than the q/k/v group: scale q up so it
    # dominates the group's amax, and check that k's fake-quant follows the group, not itself.
    model = TinyHf(dtype=torch.float32)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.q_proj.weight.mul_(40.0)
    plan = QuantizationPlan.from_presets("NVFP4", None)
    group = rollout_values(plan, [(f"model.layers.0.self_attn.{p}.weight", getattr(attn, p).weight.detach())
                                  for p in ("q_proj", "k_proj", "v_proj")])
    alone = rollout_values(plan, [("model.layers.0.self_attn.k_proj.weight", attn.k_proj.weight.detach())])
    ReferenceQatBackend().apply(model, plan)
    model(torch.randn(3, H))
    key = "model.layers.0.self_attn.k_proj.weight"
    _assert_bitwise(attn.k_proj.seen_weight, group[key], "k_proj in its group")
    assert not torch.equal(attn.k_proj.seen_weight, alone[key])


def test_fused_3d_gate_up_with_fp8_blocks_quantizes_gate_and_up_apart() -> None:
    # Rows of one 128x128 block would straddle gate and up if the 3-D tensor were quantized whole.
    w = torch.randn(2, 2 * 96, 128) * 0.05
    w[:, :96] *= 30.0
    plan = QuantizationPlan.from_presets(None, "FP8_BLOCK")
    name = "model.layers.0.mlp.experts.gate_up_proj"
    tensor = TrainerTensor(name, w.shape, (HfPart(name, w.shape),))
    (fq,) = fake_quantize_tensors(plan, [(tensor, w)])
    want = rollout_values(plan, [(name, w)])[name]
    _assert_bitwise(fq, want, name)


def test_trainer_tensor_with_interleaved_rows_is_reassembled_exactly() -> None:
    # A Megatron-like fused q/k/v: rows interleaved per query group, parts given as row numbers.
    torch.manual_seed(1)
    q, k, v = torch.randn(64, 64), torch.randn(32, 64), torch.randn(32, 64)
    rows = torch.arange(128).reshape(2, 4, 16)  # 2 groups x (2 q heads, k, v) x head_dim 16
    q_rows, k_rows, v_rows = rows[:, :2].reshape(-1), rows[:, 2].reshape(-1), rows[:, 3].reshape(-1)
    fused = torch.empty(128, 64)
    fused[q_rows], fused[k_rows], fused[v_rows] = q, k, v
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    parts = [HfPart(n, (len(r), 64), (r,)) for n, r in zip(names, (q_rows, k_rows, v_rows), strict=True)]
    plan = QuantizationPlan.from_presets("FP8_BLOCK", None)
    (fq,) = fake_quantize_tensors(plan, [(TrainerTensor("linear_qkv.weight", (128, 64), parts), fused)])
    want = rollout_values(plan, list(zip(names, (q, k, v), strict=True)))
    for n, r in zip(names, (q_rows, k_rows, v_rows), strict=True):
        _assert_bitwise(fq[r], want[n], n)


SCHEMES = [
    ("FP8_BLOCK", None, ActivationScheme.FP8_GROUP_128),
    ("MXFP8", None, ActivationScheme.MXFP8),
    ("MXFP4", None, ActivationScheme.MXFP4),
    ("MXFP4", "mxfp8", ActivationScheme.MXFP8),
    ("NVFP4", None, ActivationScheme.NVFP4_PER_TOKEN),
]


@pytest.mark.parametrize("numerics", ["engine", "compressed-tensors"])
@pytest.mark.parametrize(("preset", "activation", "scheme"), SCHEMES)
def test_activations_equal_the_codecs_dynamic_quantization(preset: str, activation: str | None,
                                                           scheme: ActivationScheme, numerics: str) -> None:
    model = TinyHf()
    plan = QuantizationPlan.from_presets(preset, preset, linear_activation=activation, moe_activation=activation,
                                         numerics=numerics)
    ReferenceQatBackend().apply(model, plan)
    x = torch.randn(6, H, dtype=torch.bfloat16) * torch.logspace(-2, 2, 6, dtype=torch.bfloat16)[:, None]
    with LinearCalls() as calls:
        model(x)
    q_proj = model.model.layers[0].self_attn.q_proj
    raw = model.model.layers[0].input_layernorm(x)
    dense = [(i, w) for i, w in calls.calls if torch.equal(w, q_proj.seen_weight)]
    assert dense, "q_proj's F.linear was not seen"
    _assert_bitwise(dense[0][0], fake_quantize_activation(scheme, raw, numerics=plan.numerics), "q_proj input")
    experts = model.model.layers[1].mlp.experts
    gate_up = experts.seen_weight["gate_up_proj"]
    expert_calls = [(i, w) for i, w in calls.calls if w.shape == gate_up.shape[1:] and torch.equal(w, gate_up[0])]
    assert len(expert_calls) == 1
    moe_in = experts.seen_input
    want = fake_quantize_activation(scheme, moe_in, numerics=plan.numerics)
    _assert_bitwise(expert_calls[0][0], want, "expert 0 gate_up input")
    router = [(i, w) for i, w in calls.calls if w.shape[0] == 2 and w.shape[1] == H]
    assert router and torch.equal(router[0][0], moe_in), "the BF16 router's input must not be fake-quantized"


def test_nvfp4_activation_scale_is_per_token_not_per_tensor() -> None:
    model = TinyHf()
    plan = QuantizationPlan.from_presets("NVFP4", None)
    ReferenceQatBackend().apply(model, plan)
    x = torch.randn(4, H, dtype=torch.bfloat16)
    proj = model.model.layers[0].self_attn.o_proj
    with LinearCalls() as small:
        proj(x)
    loud = x.clone()
    loud[0] *= 1000.0  # one loud token: a per-tensor scale would coarsen every other token
    with LinearCalls() as big:
        proj(loud)
    _assert_bitwise(big.calls[0][0][1:], small.calls[0][0][1:], "quiet tokens next to a loud one")


def test_straight_through_gradient_is_the_identity() -> None:
    w = torch.randn(32, 64, requires_grad=True)
    fq = torch.randn(32, 64)
    r = torch.randn(32, 64)
    out = straight_through(w, fq)
    _assert_bitwise(out, fq, "forward value")
    (out * r).sum().backward()
    _assert_bitwise(w.grad, r, "gradient")


@pytest.mark.parametrize("preset", PRESETS)
def test_gradients_reach_weights_and_inputs_unchanged(preset: str) -> None:
    torch.manual_seed(2)
    model = TinyHf(dtype=torch.float32)
    proj = model.model.layers[0].mlp.down_proj
    plan = QuantizationPlan.from_presets(preset, None)
    ReferenceQatBackend().apply(model, plan)
    x = torch.randn(5, 64, requires_grad=True)
    g = torch.randn(5, H)
    with LinearCalls() as calls:
        (proj(x) * g).sum().backward()
    xq, wq = calls.calls[0]
    # The reference: the same loss with the fake-quantized values as leaves.
    xq, wq = xq.requires_grad_(), wq.requires_grad_()
    (F.linear(xq, wq) * g).sum().backward()
    _assert_bitwise(proj.weight.grad, wq.grad, "weight gradient")
    _assert_bitwise(x.grad, xq.grad, "input gradient")


def test_the_plans_element_rule_reaches_the_activations() -> None:
    from domain.quant.qat import fake_quantize_input

    x = torch.randn(6, H, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)  # one NVFP4 tie
    scheme = ActivationScheme.NVFP4_PER_TOKEN
    got = {n: fake_quantize_input(QuantizationPlan.from_presets("NVFP4", None, numerics=n), scheme, x)
           for n in ("engine", "compressed-tensors")}
    assert not torch.equal(got["engine"], got["compressed-tensors"])
    for n, value in got.items():
        _assert_bitwise(value, fake_quantize_activation(scheme, x, numerics=QuantizationPlan.from_presets(
            "NVFP4", None, numerics=n).numerics), n)
