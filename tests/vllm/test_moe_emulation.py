"""adapters.vllm.moe_emulation against vLLM's own code (the CPU build of vLLM 0.32, `.venv-vllm`):
the wrapped look-ups in vLLM's compressed-tensors MoE method modules, what they answer for each
cell on this CPU, and the experts run inside vLLM's modular kernel (its prepare/finalize and
quant config) against a plain per-token reference built from rl-refit's codecs.

The end-to-end check (a micro Qwen3-MoE with quantized experts cold-starts, serves, and a refit
equals a cold start bit for bit) is the real-engine matrix (tests/vllm/test_real_engine.py).
"""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (.venv-vllm), which `make test` creates")

import torch

from adapters.vllm import moe_emulation
from domain.quant.codecs import dequantize_weight, fake_quantize_activation, quantize_weight
from domain.quant.formats import FP8_BLOCK, MXFP8, NVFP4, ActivationScheme

FORMATS = ("FP8_BLOCK", "MXFP8", "NVFP4")
E, HIDDEN, INTER, M, TOPK = 4, 256, 128, 9, 2


@pytest.fixture
def vllm_config():  # type: ignore[no-untyped-def]
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


@pytest.fixture
def wrapped():  # type: ignore[no-untyped-def]
    """The three look-ups wrapped for this test, and the process left as it was found."""
    before = moe_emulation.installed()
    moe_emulation.install(FORMATS)
    modules: dict[str, object] = {}
    for p in moe_emulation.PATCHES:  # each format's compressed-tensors MoE method module (listed first)
        modules.setdefault(p.format, importlib.import_module(p.module))
    yield modules
    if not before:
        moe_emulation.undo()


def _moe_config():  # type: ignore[no-untyped-def]
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )

    return FusedMoEConfig(num_experts=E, experts_per_token=TOPK, hidden_dim=HIDDEN, intermediate_size=INTER,
                          num_local_experts=E, num_logical_experts=E, activation=MoEActivation.SILU, device="cpu",
                          routing_method=RoutingMethodType.Renormalize,
                          moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(), in_dtype=torch.bfloat16)


def test_install_wraps_vllms_lookups_idempotently_and_undo_restores_them() -> None:
    from vllm.model_executor.layers.fused_moe.oracle import fp8, mxfp8, nvfp4

    # Each wrapped global is vLLM's oracle function, imported by the MoE method's module.
    vllms = {"select_fp8_moe_backend": fp8.select_fp8_moe_backend,
             "select_mxfp8_moe_backend": mxfp8.select_mxfp8_moe_backend,
             "select_nvfp4_moe_backend": nvfp4.select_nvfp4_moe_backend,
             "convert_to_nvfp4_moe_kernel_format": nvfp4.convert_to_nvfp4_moe_kernel_format}
    modules = [(importlib.import_module(p.module), p.name) for p in moe_emulation.PATCHES]
    before = moe_emulation.installed()
    moe_emulation.undo()
    try:
        for module, name in modules:
            assert getattr(module, name) is vllms[name]
        assert moe_emulation.install(("MXFP4",)) == []  # not steered (Marlin-only conversion on CPU)
        assert len(moe_emulation.install(FORMATS)) == len(modules) == 5
        wrappers = [getattr(m, n) for m, n in modules]
        assert all(w is not vllms[n] for w, (_, n) in zip(wrappers, modules, strict=True))
        moe_emulation.install(FORMATS)
        assert [getattr(m, n) for m, n in modules] == wrappers  # not wrapped twice
        assert sorted(moe_emulation.installed().values(), key=id) == sorted((vllms[n] for _, n in modules), key=id)
        assert len(moe_emulation.undo()) == 5
        assert all(getattr(m, n) is vllms[n] for m, n in modules)
        assert moe_emulation.undo() == []
    finally:
        moe_emulation.undo()
        if before:
            moe_emulation.install(FORMATS)


def test_each_cell_gets_vllms_answer_unless_it_cannot_run_on_cpu(vllm_config, wrapped) -> None:  # type: ignore[no-untyped-def]
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kFp8Dynamic128Sym,
        kFp8Static128BlockSym,
        kNvfp4Dynamic,
        kNvfp4Static,
    )

    from adapters.vllm import moe_emulation_experts as ours

    cfg = _moe_config()
    vllms = moe_emulation.installed()

    native = vllms["compressed_tensors_moe_w8a8_fp8.select_fp8_moe_backend"](
        cfg, kFp8Static128BlockSym, kFp8Dynamic128Sym, True)
    got = wrapped["FP8_BLOCK"].select_fp8_moe_backend(cfg, kFp8Static128BlockSym, kFp8Dynamic128Sym, True)
    if native[0] is Fp8MoeBackend.NONE:  # no AMX: vLLM's CPU FP8 MoE backends are unsupported
        assert got == (Fp8MoeBackend.TRITON, ours.TorchFp8BlockExperts)
    else:
        assert got == native

    assert wrapped["MXFP8"].select_mxfp8_moe_backend(cfg) == (Fp8MoeBackend.EMULATION, ours.TorchMxfp8Experts)

    assert wrapped["NVFP4"].select_nvfp4_moe_backend(cfg, kNvfp4Static, None) == (
        NvFp4MoeBackend.EMULATION, ours.TorchNvfp4Experts)
    with pytest.raises(NotImplementedError, match="No NvFp4 MoE backend"):  # W4A4 keeps vLLM's answer
        wrapped["NVFP4"].select_nvfp4_moe_backend(cfg, kNvfp4Static, kNvfp4Dynamic)


def _silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """vLLM's own CPU op, as the kernel applies it (BF16 in, BF16 out). The activation is vLLM's by
    design, and its CPU op is not the FP32 formula everywhere: on CPUs without AVX-512 it differs
    from `silu(gate) * up` in FP32 on about half the elements (0.4% relative), so the reference
    takes the op itself and checks rl-refit's part, the GEMMs and the codecs, on any x86 CPU."""
    out = torch.empty(*h.shape[:-1], h.shape[-1] // 2, dtype=h.dtype)
    torch.ops._C.silu_and_mul(out, h.contiguous())
    return out


def _reference(x, w13, w2, ids, weights, scheme):  # type: ignore[no-untyped-def]
    """Per token and slot, in FP64 over FP32 values: rl-refit's own activation fake-quantization
    and weight codecs; the first GEMM's output rounded to BF16 as the kernels keep it."""
    def act_q(t: torch.Tensor) -> torch.Tensor:
        return fake_quantize_activation(scheme, t.float()).double()

    out = torch.zeros(M, HIDDEN, dtype=torch.float64)
    xq = act_q(x)
    for t in range(M):
        for s in range(TOPK):
            e = int(ids[t, s])
            h = (xq[t] @ w13[e].double().t()).to(torch.bfloat16)
            out[t] += weights[t, s].double() * (act_q(_silu_and_mul(h[None]))[0] @ w2[e].double().t())
    return out


def _inputs(seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, HIDDEN, INTER, generator=g) / INTER**0.5).to(torch.bfloat16)
    x = torch.randn(M, HIDDEN, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(M)]).to(torch.int32)
    weights = torch.softmax(torch.randn(M, TOPK, generator=g), dim=-1)
    return w13, w2, x, ids, weights


def _kernel(fmt: str, q13, q2):  # type: ignore[no-untyped-def]
    """vLLM's modular kernel for the backend and experts the wrapped look-up answers, with the
    quant config vLLM's MoE method builds from the layer's tensors."""
    from vllm.model_executor.layers.fused_moe.oracle import fp8, nvfp4

    from adapters.vllm import moe_emulation_experts as ours

    cfg = _moe_config()
    if fmt == "NVFP4":
        backend = nvfp4.NvFp4MoeBackend.EMULATION
        # As CompressedTensorsW4A4Nvfp4MoEMethod: alphas are 1 / weight_global_scale; weight-only
        # checkpoints have no input global scales (vLLM allocates them, empty).
        ones = torch.ones(E)
        converted = nvfp4.convert_to_nvfp4_moe_kernel_format(
            backend, None, q13.tensors["weight_packed"], q13.tensors["weight_scale"],
            1.0 / q13.tensors["weight_global_scale"].reshape(E), ones, q2.tensors["weight_packed"],
            q2.tensors["weight_scale"], 1.0 / q2.tensors["weight_global_scale"].reshape(E), ones,
            is_act_and_mul=True, use_a16=True)
        w13, w13_scale, w13_alpha, a13, w2, w2_scale, w2_alpha, a2 = converted
        assert w13 is q13.tensors["weight_packed"] and w2 is q2.tensors["weight_packed"]  # weights untouched
        quant = nvfp4.make_nvfp4_moe_quant_config(backend, w13_scale, w2_scale, w13_alpha, w2_alpha, a13, a2,
                                                  use_a16=True)
        return nvfp4.make_nvfp4_moe_kernel(quant, cfg, ours.TorchNvfp4Experts, backend), w13, w2
    backend, experts, block = ((fp8.Fp8MoeBackend.TRITON, ours.TorchFp8BlockExperts, [128, 128]) if fmt == "FP8_BLOCK"
                               else (fp8.Fp8MoeBackend.EMULATION, ours.TorchMxfp8Experts, [1, 32]))
    w13, w2, s13, s2 = (q13.tensors["weight"], q2.tensors["weight"], q13.tensors["weight_scale"],
                        q2.tensors["weight_scale"])
    layer = type("Layer", (), {"weight_block_size": block})()
    converted = fp8.convert_to_fp8_moe_kernel_format(backend, layer, w13, w2, s13, s2, None, None)
    assert all(a is b for a, b in zip(converted, (w13, w2, s13, s2), strict=True))  # a no-op conversion
    quant = fp8.make_fp8_moe_quant_config(backend, s13, s2, None, None, block_shape=block)
    return fp8.make_fp8_moe_kernel(quant, cfg, experts, backend), w13, w2


CASES = {
    "FP8_BLOCK": (FP8_BLOCK, ActivationScheme.FP8_GROUP_128),
    "MXFP8": (MXFP8, ActivationScheme.MXFP8),
    "NVFP4": (NVFP4, ActivationScheme.NONE),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_experts_in_vllms_kernel_match_the_per_token_reference(fmt: str, vllm_config) -> None:  # type: ignore[no-untyped-def]
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    preset, scheme = CASES[fmt]
    w13, w2, x, ids, weights = _inputs(0)
    q13, q2 = quantize_weight(preset, w13), quantize_weight(preset, w2)
    kernel, k13, k2 = _kernel(fmt, q13, q2)

    def run() -> torch.Tensor:
        return kernel.apply(x.clone(), k13, k2, weights.clone(), ids.clone(), activation=MoEActivation.SILU,
                            global_num_experts=E, expert_map=None, apply_router_weight_on_input=False)

    out = run()
    assert out.dtype == torch.bfloat16 and out.shape == (M, HIDDEN)
    assert torch.equal(out, run())  # the same bits for the same inputs

    d13, d2 = dequantize_weight(q13), dequantize_weight(q2)
    ref = _reference(x, d13, d2, ids, weights, scheme)
    # The reference rounded once to BF16: equal but for the odd element one BF16 step apart (FP32
    # summation order), measured 0 to 1 of the 2304 here.
    differs = out.float() != ref.to(torch.bfloat16).float()
    assert differs.float().mean().item() <= 0.005
    assert ((out.double() - ref.to(torch.bfloat16).double()).norm() / ref.norm()).item() < 1e-6
    if scheme is not ActivationScheme.NONE:  # the activations are quantized: the A16 result is far
        a16 = _reference(x, d13, d2, ids, weights, ActivationScheme.NONE)
        assert ((out.double() - a16).norm() / a16.norm()).item() > 1e-2
