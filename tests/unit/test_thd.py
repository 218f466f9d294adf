"""THD packing: alignment, cu_seqlens, pack/unpack, labels, and fused log-probs on a pack."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from domain.errors import RefitError, ThdPackingError
from domain.forward.fused_logprob import IGNORE_INDEX, fused_logprob_entropy
from domain.forward.thd import ThdLayout, recipe_alignment, sequence_alignment


@pytest.mark.parametrize(
    ("recipe", "tp", "cp", "expected"),
    [
        (None, 1, 1, 1),
        ("delayed", 1, 1, 16),
        ("tensorwise", 2, 1, 16),
        ("blockwise", 3, 1, 48),
        ("mxfp8", 2, 2, 32),  # lcm(32, 2 * 2 * 2)
        ("delayed", 3, 2, 48),  # lcm(16, 3 * 2 * 2)
        ("MXFP8", 1, 4, 32),
        (None, 3, 2, 12),
    ],
)
def test_sequence_alignment(recipe, tp, cp, expected):
    assert sequence_alignment(recipe_alignment(recipe), tp, cp) == expected


def test_unknown_recipe_and_bad_sizes_are_typed_errors():
    with pytest.raises(ThdPackingError, match=r"'custom'.*pass the alignment"):
        recipe_alignment("custom")
    with pytest.raises(ThdPackingError, match="tp"):
        sequence_alignment(16, tp=0)
    assert issubclass(ThdPackingError, (RefitError, ValueError))


def test_plan_pads_each_sequence_and_puts_the_extra_on_the_last():
    layout = ThdLayout.plan([5, 17, 3], align=16)
    assert layout.padded_seqlens[:2] == (16, 32)
    assert layout.total == 16 * 128  # 64 aligned tokens, rounded up to a multiple of 2048
    assert layout.padded_seqlens[2] == 2048 - 48
    assert layout.cu_seqlens == (0, 5, 22, 25)
    assert layout.cu_seqlens_padded == (0, 16, 48, 2048)
    assert layout.max_seqlen == 2000
    cu = layout.cu_seqlens_tensor(padded=True)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 16, 48, 2048]
    assert layout.token_mask().sum() == 25


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 70), min_size=1, max_size=6),
    recipe=st.sampled_from([None, "delayed", "mxfp8"]),
    tp=st.integers(1, 4),
    cp=st.integers(1, 3),
)
def test_layout_invariants_and_round_trip(lengths, recipe, tp, cp):
    align = sequence_alignment(recipe_alignment(recipe), tp, cp)
    layout = ThdLayout.plan(lengths, align=align)
    assert layout.total % (align * 128) == 0
    assert all(p % align == 0 and p >= n for p, n in zip(layout.padded_seqlens, lengths, strict=True))
    # Only the last sequence carries more than its own alignment padding.
    assert all(p - n < align for p, n in zip(layout.padded_seqlens[:-1], lengths, strict=False))
    seqs = [torch.arange(n) + 1000 * i for i, n in enumerate(lengths)]
    packed = layout.pack(seqs, pad_value=-1)
    assert packed.shape == (layout.total,)
    assert int((packed == -1).sum()) == layout.total - sum(lengths)
    for got, want in zip(layout.unpack(packed), seqs, strict=True):
        assert torch.equal(got, want)
    rows, mask = layout.unpack_padded(packed.float(), fill=float("nan"))
    assert rows.shape == (len(lengths), max(lengths)) and torch.equal(mask.sum(1), torch.tensor(lengths))
    assert torch.isnan(rows[~mask]).all()


def test_next_token_labels_stay_inside_each_sequence():
    layout = ThdLayout.plan([3, 2, 4], align=4, total_multiple=16)
    ids = layout.pack([torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.tensor([6, 7, 8, 9])])
    labels = layout.next_token_labels(ids)
    x = IGNORE_INDEX
    assert labels.tolist() == [2, 3, x, x, 5, x, x, x, 7, 8, 9, x, x, x, x, x]
    pos = layout.position_ids()
    assert pos.tolist() == [0, 1, 2, 0, 0, 1, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0]


def test_fused_log_probs_on_a_pack_equal_per_sequence_plain_computation():
    h_dim, vocab = 16, 40
    weight = torch.randn(vocab, h_dim)
    lengths = [7, 1, 12]
    ids = [torch.randint(0, vocab, (n,)) for n in lengths]
    hidden = [torch.randn(n, h_dim) for n in lengths]
    layout = ThdLayout.plan(lengths, align=8, total_multiple=64)
    packed_h = layout.pack(hidden)
    labels = layout.next_token_labels(layout.pack(ids))
    lp, ent = fused_logprob_entropy(packed_h, weight, labels, temperature=0.9, chunk_size=5)
    per_seq, mask = layout.unpack_padded(lp, drop_last=True)
    for i, (h, y) in enumerate(zip(hidden, ids, strict=True)):
        ref = torch.log_softmax((h[:-1] @ weight.T) / 0.9, -1).gather(-1, y[1:, None])[:, 0]
        assert torch.allclose(per_seq[i, : lengths[i] - 1], ref, atol=1e-5)
        assert not mask[i, lengths[i] - 1 :].any()
    assert torch.all(ent[~layout.token_mask()] == 0)


def test_bad_layouts_and_inputs_are_typed_errors():
    with pytest.raises(ThdPackingError, match="no sequences"):
        ThdLayout.plan([], align=16)
    with pytest.raises(ThdPackingError, match=">= 1"):
        ThdLayout.plan([4, 0], align=16)
    with pytest.raises(ThdPackingError, match="align"):
        ThdLayout.plan([4], align=0)
    with pytest.raises(ThdPackingError, match="do not cover"):
        ThdLayout((4, 8), (8, 4))
    layout = ThdLayout.plan([4, 8], align=4, total_multiple=4)
    with pytest.raises(ThdPackingError, match="layout has 12"):
        layout.unpack(torch.zeros(11))
    with pytest.raises(ThdPackingError, match="sequence 1 has shape"):
        layout.pack([torch.zeros(4), torch.zeros(7)])
    with pytest.raises(ThdPackingError, match="got 1 sequences"):
        layout.pack([torch.zeros(4)])
