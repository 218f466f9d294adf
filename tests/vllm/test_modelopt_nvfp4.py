"""NVFP4 experts in ModelOpt's layout with per-token activations, against vLLM's own code (the CPU
build of vLLM 0.32, `.venv-vllm`):

- the export equals vLLM's online NVFP4 expert quantizer (`_quantize_moe_weight_to_nvfp4`, the
  function behind vLLM's `nvfp4_per_token` shorthand, which produces ModelOpt's layout): elements,
  block scales and the `weight_scale_2` decode scale per expert, gate and up sharing one;
- the wrapped ModelOpt look-ups answer FLASHINFER_TRTLLM with TorchNvfp4PerTokenExperts on this
  CPU, the only backend ModelOptNvFp4FusedMoE accepts for per-token activations, and the wrapped
  conversion keeps the tensors as loaded;
- those experts, in vLLM's modular kernel with the quant config vLLM builds, equal a per-token
  reference built from rl-refit's codecs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (.venv-vllm), which `make test` creates")

import torch

from adapters.vllm import moe_emulation
from domain.quant import modelopt_layout as mo
from domain.quant.codecs import nvfp4_global_scale, quantize_weight
from domain.quant.codecs.elements import e2m1_values, unpack_fp4
from domain.quant.formats import NVFP4, ActivationScheme
from tests.vllm import references as ref
from tests.vllm.compare import assert_nvfp4_values_equal, bits
from tests.vllm.test_moe_emulation import HIDDEN, E, M, _inputs, _moe_config, _reference

_MODELOPT = "vllm.model_executor.layers.quantization.modelopt"


@pytest.fixture
def vllm_config():  # type: ignore[no-untyped-def]
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


@pytest.fixture
def modelopt():  # type: ignore[no-untyped-def]
    """vLLM's ModelOpt module with the NVFP4 look-ups wrapped, and the process left as found."""
    import importlib

    before = moe_emulation.installed()
    moe_emulation.install(("NVFP4",))
    yield importlib.import_module(_MODELOPT)
    if not before:
        moe_emulation.undo()


def _export(w13: torch.Tensor, w2: torch.Tensor) -> list[dict[str, dict[str, torch.Tensor]]]:
    """rl-refit's export of each expert's gate, up and down, in ModelOpt's layout."""
    out = []
    inter = w13.shape[1] // 2
    for e in range(w13.shape[0]):
        gate, up, down = w13[e, :inter], w13[e, inter:], w2[e]
        gs = nvfp4_global_scale(gate, up)  # a fused group: one scale
        out.append({name: mo.modelopt_tensors(quantize_weight(NVFP4, t, global_scale=g).tensors)
                    for name, t, g in (("gate_proj", gate, gs), ("up_proj", up, gs),
                                       ("down_proj", down, nvfp4_global_scale(down)))})
    return out


def test_the_export_equals_vllms_online_nvfp4_expert_quantizer(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.model_executor.layers.quantization.online import nvfp4 as online

    # scaled_fp4_quant is a CUDA op; its torch mirror ref_nvfp4_quant gives the values and scales.
    monkeypatch.setattr(online, "scaled_fp4_quant", lambda w, gs, is_sf_swizzled_layout: ref.nvfp4(w, gs))
    w13, w2, *_ = _inputs(0)
    values13, scale13, scale_2_13 = online._quantize_moe_weight_to_nvfp4(w13)
    values2, scale2, scale_2_2 = online._quantize_moe_weight_to_nvfp4(w2)
    inter = w13.shape[1] // 2
    for e, expert in enumerate(_export(w13, w2)):
        for name, rows, values, scale, scale_2, src in (
                ("gate_proj", slice(0, inter), values13, scale13, scale_2_13, w13),
                ("up_proj", slice(inter, None), values13, scale13, scale_2_13, w13),
                ("down_proj", slice(None), values2, scale2, scale_2_2, w2)):
            t = expert[name]
            what = f"expert {e} {name}"
            assert torch.equal(bits(t["weight_scale_2"]), bits(scale_2[e])), what
            assert torch.equal(bits(t["weight_scale"].float()), bits(scale[e][rows])), what
            assert_nvfp4_values_equal(e2m1_values(unpack_fp4(t["weight"])), values[e][rows], src[e][rows], what)
        assert torch.equal(expert["gate_proj"]["weight_scale_2"], expert["up_proj"]["weight_scale_2"])


def test_the_modelopt_lookups_answer_trtllm_with_our_experts_on_this_cpu(vllm_config, modelopt) -> None:  # type: ignore[no-untyped-def]
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kNvfp4Dynamic,
        kNvfp4DynamicToken,
        kNvfp4Static,
    )

    from adapters.vllm.moe_emulation_experts import TorchNvfp4PerTokenExperts

    cfg = _moe_config()
    assert modelopt.select_nvfp4_moe_backend(cfg, kNvfp4Static, kNvfp4DynamicToken) == (
        NvFp4MoeBackend.FLASHINFER_TRTLLM, TorchNvfp4PerTokenExperts)
    with pytest.raises(NotImplementedError):  # static-scale W4A4 keeps vLLM's answer
        modelopt.select_nvfp4_moe_backend(cfg, kNvfp4Static, kNvfp4Dynamic)


def _per_token_kernel(modelopt, expert_tensors):  # type: ignore[no-untyped-def]
    """The kernel ModelOptNvFp4FusedMoE builds for per-token activations, from its
    process_weights_after_loading: input scales filled with 1.0, w13's first shard's decode scale,
    the (wrapped) conversion, vLLM's quant config and modular kernel."""
    from vllm.model_executor.layers.fused_moe.oracle import nvfp4

    from adapters.vllm.moe_emulation_experts import TorchNvfp4PerTokenExperts

    backend = nvfp4.NvFp4MoeBackend.FLASHINFER_TRTLLM
    w13 = torch.stack([torch.cat([x["gate_proj"]["weight"], x["up_proj"]["weight"]]) for x in expert_tensors])
    s13 = torch.stack([torch.cat([x["gate_proj"]["weight_scale"], x["up_proj"]["weight_scale"]])
                       for x in expert_tensors])
    w2 = torch.stack([x["down_proj"]["weight"] for x in expert_tensors])
    s2 = torch.stack([x["down_proj"]["weight_scale"] for x in expert_tensors])
    scale_2_13 = torch.stack([x["gate_proj"]["weight_scale_2"] for x in expert_tensors])
    scale_2_2 = torch.stack([x["down_proj"]["weight_scale_2"] for x in expert_tensors])
    converted = modelopt.convert_to_nvfp4_moe_kernel_format(
        nvfp4_backend=backend, layer=None, w13=w13, w13_scale=s13, w13_scale_2=scale_2_13,
        a13_scale=torch.ones(E, 2), w2=w2, w2_scale=s2, w2_scale_2=scale_2_2, a2_scale=torch.ones(E),
        is_act_and_mul=True, use_a16=False, trtllm_hidden_alignment=256)
    k13, k13_scale, k13_scale_2, a13, k2, k2_scale, k2_scale_2, a2 = converted
    assert k13 is w13 and k2 is w2 and k13_scale is s13 and k13_scale_2 is scale_2_13  # as loaded
    quant = nvfp4.make_nvfp4_moe_quant_config(backend, k13_scale, k2_scale, k13_scale_2, k2_scale_2, a13, a2)
    kernel = nvfp4.make_nvfp4_moe_kernel(quant, _moe_config(), TorchNvfp4PerTokenExperts, backend,
                                         per_token_activation=True)
    return kernel, k13, k2


def test_per_token_experts_in_vllms_kernel_match_the_per_token_reference(vllm_config, modelopt) -> None:  # type: ignore[no-untyped-def]
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    w13, w2, x, ids, weights = _inputs(0)
    expert_tensors = _export(w13, w2)
    kernel, k13, k2 = _per_token_kernel(modelopt, expert_tensors)

    def run() -> torch.Tensor:
        return kernel.apply(x.clone(), k13, k2, weights.clone(), ids.clone(), activation=MoEActivation.SILU,
                            global_num_experts=E, expert_map=None, apply_router_weight_on_input=False)

    out = run()
    assert out.dtype == torch.bfloat16 and out.shape == (M, HIDDEN)
    assert torch.equal(out, run())

    # The reference's weights: each expert's codes decoded with its ModelOpt decode scale.
    def deq(t: dict[str, torch.Tensor]) -> torch.Tensor:
        values = e2m1_values(unpack_fp4(t["weight"]))
        blocks = values.reshape(values.shape[0], -1, 16) * (t["weight_scale"].float() * t["weight_scale_2"]).unsqueeze(-1)
        return blocks.reshape(values.shape)

    d13 = torch.stack([torch.cat([deq(x["gate_proj"]), deq(x["up_proj"])]) for x in expert_tensors])
    d2 = torch.stack([deq(x["down_proj"]) for x in expert_tensors])
    want = _reference(x, d13, d2, ids, weights, ActivationScheme.NVFP4_PER_TOKEN)
    differs = out.float() != want.to(torch.bfloat16).float()
    assert differs.float().mean().item() <= 0.005
    assert ((out.double() - want.to(torch.bfloat16).double()).norm() / want.norm()).item() < 1e-6
    a16 = _reference(x, d13, d2, ids, weights, ActivationScheme.NONE)
    assert ((out.double() - a16).norm() / a16.norm()).item() > 1e-2  # the activations are quantized


def test_qat_nvfp4_fake_quantizes_activations_as_the_per_token_experts_quantize_them() -> None:
    from adapters.vllm.moe_emulation_experts import TorchNvfp4PerTokenExperts
    from domain.quant.plan import QuantizationPlan
    from domain.quant.qat import fake_quantize_input

    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(5)) * torch.logspace(-3, 2, 7).unsqueeze(-1)
    plan = QuantizationPlan.from_presets(moe="NVFP4")  # QAT mode nvfp4: per-token activations
    qat = fake_quantize_input(plan, ActivationScheme.NVFP4_PER_TOKEN, x)
    rollout = TorchNvfp4PerTokenExperts._activations(None, x)  # type: ignore[arg-type]  # self is unused
    assert torch.equal(qat.view(torch.int32), rollout.view(torch.int32))
