"""THD packing against megatron-core: recipe alignment, PackedSeqParams, a packed forward."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (the `megatron` extra)")

from adapters.megatron.thd import megatron_recipe_alignment, packed_seq_params, plan_packing
from adapters.megatron.trainer_model import MegatronTrainerModel
from domain.forward.mode import FusedForwardMode
from domain.forward.thd import RECIPE_ALIGNMENT, ThdLayout
from tests.megatron_cpu import megatron_cpu_env, tiny_gpt_model  # noqa: F401

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("megatron_cpu_env")]


@pytest.mark.parametrize(
    ("fp8", "fp8_recipe", "fp4", "fp4_recipe"),
    [
        ("e4m3", "delayed", None, None),
        ("hybrid", "tensorwise", None, None),
        ("e4m3", "blockwise", None, None),
        ("e4m3", "mxfp8", None, None),
        (None, None, "e2m1", "nvfp4"),
    ],
)
def test_recipe_alignment_comes_from_megatron_and_matches_the_table(fp8, fp8_recipe, fp4, fp4_recipe):
    from megatron.core.enums import Fp4Recipe, Fp8Recipe
    from megatron.core.fp4_utils import get_fp4_align_size
    from megatron.core.fp8_utils import get_fp8_align_size

    config = types.SimpleNamespace(fp8=fp8, fp8_recipe=fp8_recipe, fp4=fp4, fp4_recipe=fp4_recipe)
    got = megatron_recipe_alignment(config)
    want = get_fp8_align_size(Fp8Recipe(fp8_recipe)) if fp8 else get_fp4_align_size(Fp4Recipe(fp4_recipe))
    assert got == want == RECIPE_ALIGNMENT[fp8_recipe or fp4_recipe]
    assert megatron_recipe_alignment(types.SimpleNamespace(fp8=None, fp4=None)) == 1


def test_plan_packing_uses_recipe_tp_and_cp():
    config = types.SimpleNamespace(fp8="e4m3", fp8_recipe="delayed", fp4=None)
    layout = plan_packing(config, [5, 30], tp=3, cp=2)
    assert layout.align == 48 and layout.total % (48 * 128) == 0


def test_packed_seq_params_fields_and_megatron_seq_idx():
    layout = ThdLayout.plan([3, 6, 2], align=4, total_multiple=32)
    params = packed_seq_params(layout)
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == [0, 3, 9, 11]
    assert params.cu_seqlens_q_padded.tolist() == [0, 4, 12, 32]
    assert params.max_seqlen_q == params.max_seqlen_kv == 20
    # Megatron derives seq_idx from the padded boundaries and total_tokens.
    expected = torch.repeat_interleave(torch.arange(3), torch.tensor([4, 8, 20])).to(torch.int32)
    assert torch.equal(params.seq_idx[0], expected)


@pytest.mark.parametrize("mode", [FusedForwardMode.HOOK, FusedForwardMode.LEGACY])
def test_packed_forward_equals_one_sequence_at_a_time(mode):
    # Megatron's local attention does not take packed input (that needs Transformer Engine), so
    # the model here has no transformer layers: every token is then scored from its own
    # embedding and position, and a packed forward must match per-sequence forwards exactly.
    model = tiny_gpt_model(tied=False, max_sequence_length=32)
    model.decoder.layers = torch.nn.ModuleList()
    trainer = MegatronTrainerModel.build(model, mode, chunk_size=7)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 64, (n,), generator=gen) for n in (5, 9, 2, 17)]
    packed = trainer.log_probs_packed(seqs, temperature=0.8)
    assert len(packed) == 4
    for seq, (lp, ent) in zip(seqs, packed, strict=True):
        ref_lp, ref_ent = trainer.log_probs(seq[None], temperature=0.8)
        assert lp.shape == ent.shape == (seq.shape[0] - 1,)
        assert torch.allclose(lp, ref_lp[0], atol=1e-6) and torch.allclose(ent, ref_ent[0], atol=1e-6)
