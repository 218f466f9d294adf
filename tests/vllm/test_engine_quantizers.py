"""The `engine` element rule against vLLM's own quantizers, every element and scale, bit for bit.

The weights are the test matrix (tests/codecs/matrix.py): real-shaped weights, normals at several
scales, special values, all-zero and tiny-amax blocks, exact ties, subnormals, edge blocks, 3-D
experts (per expert, as vLLM's online MoE methods quantize them), and a fused q/k/v group sharing
one NVFP4 global scale. The references are in tests/vllm/references.py (vLLM's functions where they
run on CPU, literal ports of its GPU kernels where they do not). The same matrix equals
compressed-tensors' functions under the `compressed-tensors` rule (test_compressed_tensors_rule.py)
and, for the two rules together, the references disagree with each other on real weights, so the
rule decides bits.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (.venv-vllm), which `make test` creates")

import torch  # noqa: E402

from domain.quant.codecs import fake_quantize_activation, nvfp4_global_scale, quantize_weight  # noqa: E402
from domain.quant.codecs.elements import e2m1_values, unpack_fp4  # noqa: E402
from domain.quant.formats import FP8_BLOCK, MXFP4, MXFP8, NVFP4, ActivationScheme, ElementRule  # noqa: E402
from tests.codecs.matrix import cases, fused_group, real_shaped  # noqa: E402
from tests.vllm import references as ref  # noqa: E402

ENGINE = ElementRule.ENGINE


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _per_expert(w: torch.Tensor) -> list[torch.Tensor]:
    return list(w) if w.dim() == 3 else [w]


def _pick(tensors: dict[str, torch.Tensor], e: int, experts: bool) -> dict[str, torch.Tensor]:
    return {k: t[e] for k, t in tensors.items()} if experts else tensors


def _ids(params: list[tuple[str, torch.Tensor]]) -> list[str]:
    return [name for name, _ in params]


FP8_CASES = list(cases(FP8_BLOCK).items())
MXFP8_CASES = list(cases(MXFP8).items())
MXFP4_CASES = list(cases(MXFP4).items())
NVFP4_CASES = list(cases(NVFP4).items())


@pytest.mark.parametrize(("case", "w"), FP8_CASES, ids=_ids(FP8_CASES))
def test_fp8_block_equals_per_block_cast_to_fp8(case: str, w: torch.Tensor) -> None:
    ours = quantize_weight(FP8_BLOCK, w, numerics=ENGINE).tensors
    for e, one in enumerate(_per_expert(w)):
        q, scale = ref.fp8_block(one)
        mine = _pick(ours, e, w.dim() == 3)
        assert torch.equal(_bits(mine["weight_scale"]), _bits(scale)), case
        assert torch.equal(_bits(mine["weight"]), _bits(q)), case


@pytest.mark.parametrize(("case", "w"), MXFP8_CASES, ids=_ids(MXFP8_CASES))
def test_mxfp8_equals_vllm_online_mxfp8(case: str, w: torch.Tensor) -> None:
    ours = quantize_weight(MXFP8, w, numerics=ENGINE).tensors
    q, scale = ref.mxfp8(w)
    assert torch.equal(ours["weight_scale"], scale), case
    assert torch.equal(_bits(ours["weight"]), _bits(q)), case


@pytest.mark.parametrize(("case", "w"), MXFP4_CASES, ids=_ids(MXFP4_CASES))
def test_mxfp4_equals_vllm_mxfp4_quantize(case: str, w: torch.Tensor) -> None:
    ours = quantize_weight(MXFP4, w, numerics=ENGINE).tensors
    packed, scale = ref.mxfp4(w)
    assert torch.equal(ours["weight_scale"], scale), case
    assert torch.equal(ours["weight_packed"], packed), case


def _check_nvfp4(case: str, mine: dict[str, torch.Tensor], one: torch.Tensor, gs: torch.Tensor) -> None:
    values, scale = ref.nvfp4(one, gs)
    assert torch.equal(_bits(mine["weight_global_scale"].reshape(1)), _bits(gs)), case
    assert torch.equal(_bits(mine["weight_scale"].float()), _bits(scale)), case
    got = e2m1_values(unpack_fp4(mine["weight_packed"]))
    # Bit for bit, except the sign of a zero: it is the input's sign bit, as the kernel's
    # cvt.rn.satfinite.e2m1x2.f32 keeps it, where the mirror's torch.sign(x) * |q| turns a
    # product that was -0.0 (an input of -0.0, or one that underflowed) into +0.
    zero = values == 0
    assert torch.equal(_bits(got)[~zero], _bits(values)[~zero]), case
    assert bool((got[zero] == 0).all()), case
    assert torch.equal(torch.signbit(got[zero]), torch.signbit(one.float()[zero])), case


@pytest.mark.parametrize(("case", "w"), NVFP4_CASES, ids=_ids(NVFP4_CASES))
def test_nvfp4_equals_ref_nvfp4_quant(case: str, w: torch.Tensor) -> None:
    ours = quantize_weight(NVFP4, w, numerics=ENGINE).tensors
    for e, one in enumerate(_per_expert(w)):
        _check_nvfp4(case, _pick(ours, e, w.dim() == 3), one, ref.nvfp4_global_scale(one))


def test_nvfp4_fused_group_shares_vllms_global_scale() -> None:
    group = fused_group()
    gs = nvfp4_global_scale(*group.values(), numerics=ENGINE)
    want = ref.nvfp4_global_scale(*group.values())
    assert torch.equal(_bits(gs), _bits(want))
    for name, w in group.items():
        _check_nvfp4(name, quantize_weight(NVFP4, w, global_scale=gs, numerics=ENGINE).tensors, w, want)


def test_nvfp4_negative_zero_keeps_its_sign_bit() -> None:
    w = torch.randn(4, 32, dtype=torch.bfloat16)
    w[0, :3] = torch.tensor([-0.0, 0.0, -0.0])
    codes = unpack_fp4(quantize_weight(NVFP4, w, numerics=ENGINE).tensors["weight_packed"])
    assert codes[0, :3].tolist() == [8, 0, 8]
    _check_nvfp4("negative zero", quantize_weight(NVFP4, w, numerics=ENGINE).tensors, w, ref.nvfp4_global_scale(w))


# --- activations -----------------------------------------------------------------------------------


def _activations(seed: int) -> torch.Tensor:
    """[32, 512] bf16 tokens with per-token scales from 1e-2 to 1e2 and a few outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 512, generator=g) * torch.logspace(-2, 2, 32).unsqueeze(-1)
    x[3, 7] = 300.0
    return x.to(torch.bfloat16)


def test_fp8_group_activations_equal_vllms_per_token_group_quant() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config

    x = _activations(1)
    ours = fake_quantize_activation(ActivationScheme.FP8_GROUP_128, x, numerics=ENGINE)
    with set_current_vllm_config(VllmConfig()):
        q, scale = ref.fp8_group_activation_native(x)
    assert bool((scale >= 1 / (448 * 512)).all())  # above the torch version's scale floor
    want = (q.float().reshape(32, 4, 128) * scale.unsqueeze(-1)).reshape(32, 512).to(x.dtype)
    assert torch.equal(_bits(ours), _bits(want))


def test_fp8_group_activations_floor_tiny_groups_as_the_cuda_kernel() -> None:
    x = torch.randn(8, 256, dtype=torch.float32)
    x[:4] *= torch.tensor([0.0, 1e-12, 1e-9, 1e-4]).unsqueeze(-1)
    q, scale = ref.fp8_group_activation_kernel(x)
    want = (q.float().reshape(8, 2, 128) * scale.unsqueeze(-1)).reshape(8, 256)
    ours = fake_quantize_activation(ActivationScheme.FP8_GROUP_128, x, numerics=ENGINE)
    assert torch.equal(_bits(ours), _bits(want))


def test_mx_activations_equal_vllms_quantizers() -> None:
    x = _activations(2)
    q8, s8 = ref.mxfp8(x)
    want8 = (q8.float().reshape(32, 16, 32) * torch.exp2(s8.float() - 127).unsqueeze(-1)).reshape(32, 512)
    assert torch.equal(_bits(fake_quantize_activation(ActivationScheme.MXFP8, x, numerics=ENGINE)),
                       _bits(want8.to(x.dtype)))
    p4, s4 = ref.mxfp4(x)
    want4 = (e2m1_values(unpack_fp4(p4)).reshape(32, 16, 32) * torch.exp2(s4.float() - 127).unsqueeze(-1))
    assert torch.equal(_bits(fake_quantize_activation(ActivationScheme.MXFP4, x, numerics=ENGINE)),
                       _bits(want4.reshape(32, 512).to(x.dtype)))


def test_nvfp4_per_token_activations_follow_ref_nvfp4_quant_per_token() -> None:
    x = _activations(3)
    ours = fake_quantize_activation(ActivationScheme.NVFP4_PER_TOKEN, x, numerics=ENGINE)
    for t in range(x.shape[0]):
        row = x[t:t + 1]
        gs = ref.nvfp4_global_scale(row)
        values, scale = ref.nvfp4(row, gs)
        want = (values.reshape(1, 32, 16) * (scale.unsqueeze(-1) / gs)).reshape(1, 512).to(x.dtype)
        assert torch.equal(_bits(ours[t:t + 1]), _bits(want)), t


# --- the two rules disagree on real weights ---------------------------------------------------------


def test_the_references_disagree_so_the_rule_decides_bits() -> None:
    # How many elements tie depends on the block maxima (none to 0.2% over seeds); on this
    # weight both formats have some.
    w = real_shaped(256, 512, 4)
    fp8 = {r: quantize_weight(FP8_BLOCK, w, numerics=r).tensors for r in ElementRule}
    differ = (_bits(fp8[ElementRule.ENGINE]["weight"]) != _bits(fp8[ElementRule.COMPRESSED_TENSORS]["weight"]))
    assert torch.equal(fp8[ElementRule.ENGINE]["weight_scale"], fp8[ElementRule.COMPRESSED_TENSORS]["weight_scale"])
    assert 0 < int(differ.sum()) < w.numel() // 100  # ties only: a small share, but not none
    q, _ = ref.fp8_block(w)
    assert torch.equal(_bits(fp8[ElementRule.ENGINE]["weight"]), _bits(q))
    nv = {r: quantize_weight(NVFP4, w, numerics=r).tensors["weight_packed"] for r in ElementRule}
    assert 0 < int((nv[ElementRule.ENGINE] != nv[ElementRule.COMPRESSED_TENSORS]).sum()) < w.numel() // 200
