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

import torch

from domain.quant.codecs import fake_quantize_activation, nvfp4_global_scale, quantize_weight
from domain.quant.codecs.elements import e2m1_values, unpack_fp4
from domain.quant.formats import FORMATS, FP8_BLOCK, MXFP4, MXFP8, NVFP4, ActivationScheme, ElementRule
from tests.codecs.matrix import cases, fused_group, real_shaped
from tests.vllm import references as ref
from tests.vllm.compare import assert_equals_vllm
from tests.vllm.compare import bits as _bits

ENGINE = ElementRule.ENGINE


def _per_expert(w: torch.Tensor) -> list[torch.Tensor]:
    return list(w) if w.dim() == 3 else [w]


def _pick(tensors: dict[str, torch.Tensor], e: int, experts: bool) -> dict[str, torch.Tensor]:
    return {k: t[e] for k, t in tensors.items()} if experts else tensors


MATRIX = [(fmt.name, name, w) for fmt in (FP8_BLOCK, MXFP8, MXFP4, NVFP4) for name, w in cases(fmt).items()]


@pytest.mark.parametrize(("preset", "case", "w"), MATRIX, ids=[f"{p}-{c}" for p, c, _ in MATRIX])
def test_the_matrix_equals_vllms_quantizers(preset: str, case: str, w: torch.Tensor) -> None:
    fmt = FORMATS[preset]
    ours = quantize_weight(fmt, w, numerics=ENGINE).tensors
    for e, one in enumerate(_per_expert(w)):
        assert_equals_vllm(fmt, _pick(ours, e, w.dim() == 3), one, what=f"{preset} {case} [{e}]")


def test_nvfp4_fused_group_shares_vllms_global_scale() -> None:
    group = fused_group()
    gs = nvfp4_global_scale(*group.values(), numerics=ENGINE)
    want = ref.nvfp4_global_scale(*group.values())
    assert torch.equal(_bits(gs), _bits(want))
    for name, w in group.items():
        assert_equals_vllm(NVFP4, quantize_weight(NVFP4, w, global_scale=gs, numerics=ENGINE).tensors, w, want, name)


def test_e2m1_negative_zero_keeps_its_sign_bit() -> None:
    w = torch.randn(4, 32, dtype=torch.bfloat16)
    w[0, :3] = torch.tensor([-0.0, 0.0, -0.0])
    for fmt in (NVFP4, MXFP4):
        tensors = quantize_weight(fmt, w, numerics=ENGINE).tensors
        assert unpack_fp4(tensors["weight_packed"])[0, :3].tolist() == [8, 0, 8]
        assert_equals_vllm(fmt, tensors, w, what=fmt.name)
    ct = quantize_weight(NVFP4, w, numerics=ElementRule.COMPRESSED_TENSORS).tensors
    assert unpack_fp4(ct["weight_packed"])[0, :3].tolist() == [0, 0, 0]


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


def test_nvfp4_per_token_activations_follow_vllms_per_token_scale_and_ref_nvfp4_quant() -> None:
    # vLLM's per-token NVFP4 experts (quantize_nvfp4_per_token_input) hand FlashInfer the base scale
    # NVFP4_PER_TOKEN_BASE_GLOBAL_SCALE: the decode scale is amax * base, the encode scale its
    # reciprocal, and each 1 x 16 block is scaled as ref_nvfp4_quant scales it with that encode scale.
    from vllm.model_executor.layers.quantization.utils.flashinfer_utils import (
        NVFP4_PER_TOKEN_BASE_GLOBAL_SCALE,
    )

    x = _activations(3)
    ours = fake_quantize_activation(ActivationScheme.NVFP4_PER_TOKEN, x, numerics=ENGINE)
    base = torch.tensor(NVFP4_PER_TOKEN_BASE_GLOBAL_SCALE, dtype=torch.float32)
    for t in range(x.shape[0]):
        row = x[t:t + 1]
        per_token_scale = row.float().abs().amax() * base
        values, scale = ref.nvfp4(row, (1.0 / per_token_scale).reshape(1))
        want = (values.reshape(1, 32, 16) * scale.unsqueeze(-1) * per_token_scale).reshape(1, 512).to(x.dtype)
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
