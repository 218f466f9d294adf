"""adapters.vllm.moe_emulation without vLLM: the install/undo of the wrapped expert-backend
look-ups (on a stand-in module), the FP8 dequantization against compressed-tensors' own, and the
experts' FP32 forward against a per-token loop."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from adapters.vllm import cpu_emulation, moe_emulation
from adapters.vllm.moe_emulation import SelectorPatch

FAKE = "tests_fake_ct_moe_method"
STEER = "tests_fake_steer"
PATCH = (SelectorPatch("FP8_BLOCK", FAKE, "select", f"{STEER}:wrap"),)


def _ours() -> dict[str, object]:
    return {k: v for k, v in moe_emulation.installed().items() if k.startswith(FAKE)}


def _vllm_select(config: object) -> tuple[str, str]:
    return "NONE", f"vllm:{config}"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A stand-in for a compressed-tensors MoE method module, and a steer for its look-up."""
    module = types.ModuleType(FAKE)
    module.select = _vllm_select  # type: ignore[attr-defined]
    steer = types.ModuleType(STEER)

    def wrap(original):  # type: ignore[no-untyped-def]
        def select(config: object) -> tuple[str, str]:
            backend, experts = original(config)
            return ("OURS", experts) if backend == "NONE" else (backend, experts)
        return select

    steer.wrap = wrap  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, FAKE, module)
    monkeypatch.setitem(sys.modules, STEER, steer)
    yield module
    moe_emulation.undo(PATCH)  # only the stand-in: the real look-ups may be wrapped in this process


def test_install_wraps_the_lookup_and_undo_puts_vllms_back(fake: types.ModuleType) -> None:
    assert moe_emulation.install(("FP8_BLOCK",), PATCH) == [f"{FAKE}.select"]
    assert fake.select is not _vllm_select
    assert fake.select("c") == ("OURS", "vllm:c")
    assert _ours() == {f"{FAKE}.select": _vllm_select}

    assert moe_emulation.undo(PATCH) == [f"{FAKE}.select"]
    assert fake.select is _vllm_select
    assert _ours() == {}
    assert moe_emulation.undo(PATCH) == []  # nothing left to undo


def test_install_is_idempotent(fake: types.ModuleType) -> None:
    moe_emulation.install(("FP8_BLOCK",), PATCH)
    wrapper = fake.select
    assert moe_emulation.install(("FP8_BLOCK",), PATCH) == [f"{FAKE}.select"]
    assert fake.select is wrapper  # not wrapped twice
    assert _ours()[f"{FAKE}.select"] is _vllm_select  # the backup is still vLLM's own
    moe_emulation.undo(PATCH)
    assert fake.select is _vllm_select


def test_install_leaves_formats_not_emulated_alone(fake: types.ModuleType) -> None:
    assert moe_emulation.install(("MXFP8", "NVFP4"), PATCH) == []
    assert moe_emulation.install((), PATCH) == []
    assert fake.select is _vllm_select
    assert _ours() == {}


def test_undo_leaves_a_later_patch_alone(fake: types.ModuleType) -> None:
    moe_emulation.install(("FP8_BLOCK",), PATCH)

    def someone_elses(config: object) -> tuple[str, str]:
        return "THEIRS", ""

    fake.select = someone_elses  # type: ignore[attr-defined]
    assert moe_emulation.undo(PATCH) == []
    assert fake.select is someone_elses
    assert _ours() == {}


def test_one_wrapper_per_lookup_for_formats_the_linear_plugin_knows() -> None:
    names = [f.name for f in cpu_emulation.FORMATS]
    # compressed-tensors' three expert methods; ModelOpt's NVFP4 experts (per-token activations):
    # its backend choice and its conversion to the kernel's format
    assert [p.format for p in moe_emulation.PATCHES] == ["FP8_BLOCK", "MXFP8", "NVFP4", "NVFP4", "NVFP4"]
    assert {p.format for p in moe_emulation.PATCHES} <= set(names)
    assert len({(p.module, p.name) for p in moe_emulation.PATCHES}) == len(moe_emulation.PATCHES)
    for patch in moe_emulation.PATCHES:
        assert callable(moe_emulation.resolve(patch.wrapper))  # resolvable without vLLM (vLLM is imported on call)
        assert patch.module.startswith(("vllm.model_executor.layers.quantization.compressed_tensors.",
                                        "vllm.model_executor.layers.quantization.modelopt"))


# --- numerics -------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(256, 384), (200, 320)])  # whole blocks, and cropped edge blocks
def test_fp8_block_dequantization_is_compressed_tensors_bit_for_bit(shape: tuple[int, int]) -> None:
    pytest.importorskip("compressed_tensors", reason="the reference is compressed-tensors' own decompression")
    from domain.quant.formats import FP8_BLOCK
    from tests.codecs import ct_reference

    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    tensors = ct_reference.quantize(FP8_BLOCK, w)
    ours = moe_emulation.dequantize_fp8_block(tensors["weight"], tensors["weight_scale"], (128, 128))
    try:
        reference = ct_reference.decompress(FP8_BLOCK, tensors)
    except RuntimeError as err:  # compressed-tensors 0.17 (the vLLM environment's) cannot crop edge blocks
        pytest.skip(f"this compressed-tensors cannot decompress a {shape} FP8 block weight: {err}")
    assert torch.equal(ours, reference.float())


def test_group_dequantization_is_compressed_tensors_bit_for_bit() -> None:
    pytest.importorskip("compressed_tensors", reason="the reference is compressed-tensors' own dequantize")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    g = torch.Generator().manual_seed(1)
    qdata = (torch.randn(5, 256, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(5, 2, generator=g) + 0.5
    args = QuantizationArgs(num_bits=8, type="float", strategy="group", group_size=128, symmetric=True, dynamic=True)
    assert torch.equal(moe_emulation.dequantize_groups(qdata, scale, 128),
                       dequantize(qdata, scale, args=args, dtype=torch.float32))


E, K, INTER, M, TOPK = 4, 64, 32, 7, 2


def _problem(seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * INTER, K, generator=g) / K**0.5
    w2 = torch.randn(E, K, INTER, generator=g) / INTER**0.5
    x = torch.randn(M, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(M)])
    weights = torch.softmax(torch.randn(M, TOPK, generator=g), dim=-1)
    return w13, w2, x, ids, weights


def _silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _per_token(x, w13, w2, ids, weights, on_input=False):  # type: ignore[no-untyped-def]
    out = torch.zeros(M, K, dtype=torch.float64)
    for t in range(M):
        for s in range(TOPK):
            e = int(ids[t, s])
            if e < 0:
                continue
            y = _silu_and_mul(x[t].double() @ w13[e].double().t()) @ w2[e].double().t()
            out[t] += y if on_input else weights[t, s].double() * y
    return out


def test_experts_forward_is_the_per_token_sum() -> None:
    w13, w2, x, ids, weights = _problem()
    out = moe_emulation.experts_forward(x, weights, ids, lambda e: (w13[e], w2[e]), _silu_and_mul)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _per_token(x, w13, w2, ids, weights), rtol=1e-5, atol=1e-5)


def test_experts_forward_applies_router_weights_once() -> None:
    w13, w2, x, ids, weights = _problem(1)
    out = moe_emulation.experts_forward(x, weights, ids, lambda e: (w13[e], w2[e]), _silu_and_mul,
                                        apply_router_weight_on_input=True)
    torch.testing.assert_close(out.double(), _per_token(x, w13, w2, ids, weights, on_input=True),
                               rtol=1e-5, atol=1e-5)


def test_experts_on_another_rank_contribute_nothing() -> None:
    w13, w2, x, ids, weights = _problem(2)
    remote = ids.clone()
    remote[remote == 3] = -1  # expert 3 lives on another rank
    seen: list[int] = []

    def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(e)
        return w13[e], w2[e]

    out = moe_emulation.experts_forward(x, weights, remote, expert, _silu_and_mul)
    assert seen == sorted(set(remote[remote >= 0].tolist()))  # each routed expert once, in id order
    torch.testing.assert_close(out.double(), _per_token(x, w13, w2, remote, weights), rtol=1e-5, atol=1e-5)
    nothing = torch.full_like(ids, -1)
    assert torch.equal(moe_emulation.experts_forward(x, weights, nothing, expert, _silu_and_mul),
                       torch.zeros(M, K))


def test_experts_forward_gives_the_same_bits_for_the_same_inputs() -> None:
    w13, w2, x, ids, weights = _problem(3)

    def run() -> torch.Tensor:
        return moe_emulation.experts_forward(x.clone(), weights.clone(), ids.clone(),
                                             lambda e: (w13[e].clone(), w2[e].clone()), _silu_and_mul)

    first = run()
    assert all(torch.equal(first, run()) for _ in range(3))
