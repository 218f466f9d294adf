"""Packed-sequence boundaries for GDN layers: resolution, validation, seq_idx without host sync."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from domain.errors import (
    InvalidPackedBoundaries,
    PackedGdnDeterministic,
    RefitError,
    UnsupportedCombination,
)
from domain.forward.gdn_packing import (
    build_seq_idx,
    full_sequence_length,
    reject_packed_deterministic,
    resolve_cu_seqlens,
    sequence_starts,
    validate_cu_seqlens,
)
from domain.forward.varlen_kernels import gated_delta_rule


def cu(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def seq_idx_from_lengths(lengths: list[int], total: int) -> list[int]:
    """Plain-Python reference: sample i repeated lengths[i] times, then the tail as sample N."""
    out = [i for i, n in enumerate(lengths) for _ in range(n)]
    return out + [len(lengths)] * (total - len(out))


# --- seq_idx --------------------------------------------------------------------------------


def test_seq_idx_of_two_length_two_sequences() -> None:
    seq_idx = build_seq_idx(cu(0, 2, 4), 4)
    assert seq_idx.tolist() == [[0, 0, 1, 1]]
    assert seq_idx.dtype == torch.int32
    assert seq_idx.shape == (1, 4)


def test_seq_idx_single_sequence_is_all_zero() -> None:
    assert build_seq_idx(cu(0, 5), 5).tolist() == [[0] * 5]


def test_seq_idx_zero_length_tail_and_zero_length_middle() -> None:
    # [0, 3, 3, 5, 5]: an empty sample in the middle and an empty tail.
    assert build_seq_idx(cu(0, 3, 3, 5, 5), 5).tolist() == [[0, 0, 0, 2, 2]]


def test_seq_idx_with_padded_boundaries_and_padding_marked() -> None:
    cu_q, cu_q_padded = cu(0, 3, 5), cu(0, 4, 8)
    boundaries, name = resolve_cu_seqlens(cu_q_padded, cu_q)
    assert name == "cu_seqlens_q_padded"
    assert build_seq_idx(boundaries, 8).tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]
    marked = build_seq_idx(boundaries, 8, cu_seqlens_actual=cu_q)
    assert marked.tolist() == [[0, 0, 0, -1, 1, 1, -1, -1]]


def test_seq_idx_tokens_past_the_last_boundary_form_one_more_sample() -> None:
    # The total is appended unconditionally: no branch on whether cu_seqlens[-1] == T.
    assert build_seq_idx(cu(0, 2, 3), 6).tolist() == [[0, 0, 1, 2, 2, 2]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=8), st.integers(0, 4))
def test_seq_idx_matches_plain_python(lengths: list[int], extra: int) -> None:
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    total = bounds[-1] + extra
    got = build_seq_idx(torch.tensor(bounds, dtype=torch.int64), total)
    assert got.tolist() == [seq_idx_from_lengths(lengths, total)]


def test_sequence_starts() -> None:
    starts = sequence_starts(build_seq_idx(cu(0, 2, 3, 6), 6))
    assert starts.tolist() == [True, False, True, True, False, False]
    assert sequence_starts(torch.zeros(1, 0, dtype=torch.int32)).tolist() == []


# --- no device-to-host synchronization --------------------------------------------------------


class HostSync(AssertionError):
    pass


_SYNCING = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.masked_select,
    torch.Tensor.masked_select,
    torch.unique,
    torch.Tensor.unique,
}


class NoHostSync(torch.Tensor):
    """A tensor that raises on every operation that would read its values on the host."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNCING:
            raise HostSync(f"{getattr(func, '__name__', func)} reads tensor values on the host")
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if (func in (torch.repeat_interleave, torch.Tensor.repeat_interleave) and "output_size" not in kwargs
                and isinstance(repeats, torch.Tensor)):
            raise HostSync("repeat_interleave by a tensor without output_size synchronizes")
        if func is torch.Tensor.to and any(
            isinstance(a, (str, torch.device)) for a in (*args, *kwargs.values())
        ):
            raise HostSync("moving to another device synchronizes")
        return super().__torch_function__(func, types, args, kwargs)


def no_sync(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(NoHostSync)


def test_the_sync_detector_catches_a_host_read() -> None:
    boundaries = no_sync(cu(0, 2, 4))
    with pytest.raises(HostSync):
        boundaries[-1].item()
    with pytest.raises(HostSync):
        if boundaries[-1] == 4:  # Python control flow on a tensor value
            pass
    with pytest.raises(HostSync):
        validate_cu_seqlens(boundaries, 4)  # validation reads values, by design


def test_build_seq_idx_has_no_host_sync() -> None:
    boundaries = no_sync(cu(0, 3, 5))
    seq_idx = build_seq_idx(boundaries, 8, cu_seqlens_actual=no_sync(cu(0, 2, 3)))
    starts = sequence_starts(seq_idx)
    assert isinstance(seq_idx, NoHostSync)  # every step ran through the detector
    assert seq_idx.as_subclass(torch.Tensor).tolist() == [[0, 0, -1, 1, -1, -1, -1, -1]]
    assert starts.as_subclass(torch.Tensor).tolist() == [True, False, True, True, True, False, False, False]


def test_gated_delta_rule_reference_reads_no_boundary_on_the_host() -> None:
    q = torch.randn(1, 5, 1, 4)
    out = gated_delta_rule(
        q,
        q,
        torch.randn(1, 5, 1, 2),
        -torch.rand(1, 5, 1),
        torch.rand(1, 5, 1),
        cu_seqlens=no_sync(cu(0, 2, 5)),
    )
    assert out.shape == (1, 5, 1, 2)


# --- resolution and validation ------------------------------------------------------------------


def test_resolve_prefers_padded_boundaries() -> None:
    padded, actual = cu(0, 4, 8), cu(0, 3, 5)
    assert resolve_cu_seqlens(padded, actual)[0] is padded
    assert resolve_cu_seqlens(None, actual) == (actual, "cu_seqlens_q")


def test_resolve_without_any_boundary_is_a_typed_error() -> None:
    with pytest.raises(InvalidPackedBoundaries, match="neither cu_seqlens_q nor cu_seqlens_q_padded"):
        resolve_cu_seqlens(None, None)


def test_full_sequence_length_counts_sequence_and_context_parallel() -> None:
    assert full_sequence_length(6, sp_size=2, cp_size=2) == 24
    assert full_sequence_length(6) == 6
    with pytest.raises(ValueError, match="sp_size"):
        full_sequence_length(6, sp_size=0)


@pytest.mark.parametrize(
    ("boundaries", "total"),
    [(cu(0, 5), 5), (cu(0, 2, 4), 4), (cu(0, 3, 3, 7, 7), 7), (torch.tensor([0, 4, 8]), 8)],
)
def test_valid_boundaries_pass_and_come_back_as_ints(boundaries: torch.Tensor, total: int) -> None:
    assert validate_cu_seqlens(boundaries, total) == boundaries.tolist()


@pytest.mark.parametrize(
    ("boundaries", "total", "message"),
    [
        (cu(0, 2, 4), 6, "ends at 4 but the packed sequence has 6 tokens"),
        (cu(0, 4, 2, 6), 6, r"decreases at index 2 \(4 -> 2\)"),
        (cu(1, 3, 6), 6, "starts at 1, not 0"),
        (cu(0), 0, "at least one sequence"),
        (cu(0, 2, 4).reshape(1, 3), 4, "at least one sequence"),
        (torch.tensor([0.0, 4.0]), 4, "not an integer type"),
    ],
)
def test_invalid_boundaries_are_typed_errors(boundaries: torch.Tensor, total: int, message: str) -> None:
    with pytest.raises(InvalidPackedBoundaries, match=message) as info:
        validate_cu_seqlens(boundaries, total, name="cu_seqlens_q_padded")
    assert isinstance(info.value, ValueError) and isinstance(info.value, RefitError)
    assert info.value.name == "cu_seqlens_q_padded"
    assert "packed_seq_params.cu_seqlens_q_padded" in str(info.value)


def test_context_parallel_needs_lengths_divisible_by_cp_size() -> None:
    assert validate_cu_seqlens(cu(0, 4, 8), 8, cp_size=2) == [0, 4, 8]
    with pytest.raises(
        InvalidPackedBoundaries, match=r"\[3, 5\] are not multiples of context_parallel_size=2"
    ):
        validate_cu_seqlens(cu(0, 3, 8), 8, cp_size=2)


# --- deterministic mode -----------------------------------------------------------------------


def test_deterministic_mode_with_packed_input_is_rejected_with_the_reason() -> None:
    with pytest.raises(PackedGdnDeterministic) as info:
        reject_packed_deterministic(True, layer="decoder.layers.0.self_attention")
    err = info.value
    assert isinstance(err, UnsupportedCombination) and isinstance(err, ValueError)
    text = str(err)
    assert "decoder.layers.0.self_attention" in text
    assert "not varlen-aware" in text
    assert "deterministic_mode=false" in text


def test_non_deterministic_mode_passes() -> None:
    assert reject_packed_deterministic(False) is None
