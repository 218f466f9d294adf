"""Packed (THD) sequence boundaries for GatedDeltaNet (GDN) layers.

A packed batch is one sequence of `T` tokens holding several samples back to back. GDN layers run
a causal depthwise convolution and a linear recurrence along the sequence; both must restart at
every sample boundary, or one sample leaks into the next. The boundaries come as cumulative
sequence lengths (`cu_seqlens`, `[N + 1]`, from 0 to `T`); the convolution kernels also take them
as `seq_idx` (`[1, T]`, int32, the sample index of each token).

Three kinds of functions live here:
- `resolve_cu_seqlens` / `full_sequence_length`: which boundaries apply and what they must add up to;
- `check_boundary_values` / `validate_cu_seqlens`: check the boundaries. The first works on host
  integers (a batch's `PackedBoundaries`, read once where the batch's packed parameters are
  built); the second reads a tensor's values on the host, once;
- `build_seq_idx` / `sequence_starts`: tensor-only, with no device-to-host synchronization, so
  they are safe in CUDA-graph capture and never stall the stream.

A GDN layer never reads boundaries on the host: it checks the batch's `PackedBoundaries` (Python
integers) against its own packed length, and builds `seq_idx` on the device.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs
import torch

from domain.errors import InvalidPackedBoundaries, PackedGdnDeterministic
from domain.keys import key as config_key

CU_SEQLENS_Q = "cu_seqlens_q"
CU_SEQLENS_Q_PADDED = "cu_seqlens_q_padded"

_INTEGER_DTYPES = (torch.int32, torch.int64)


def resolve_cu_seqlens(
    cu_seqlens_q_padded: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None
) -> tuple[torch.Tensor, str]:
    """Pick the boundaries a GDN layer must respect.

    With alignment padding (FP8/FP4 recipes, context parallelism) each sample owns a padded slot;
    the padded boundaries are where slots start, so they win when present. Padding tokens sit at
    the end of their own sample's slot, after its real tokens, so a causal layer never lets them
    reach a real token.

    Args:
        cu_seqlens_q_padded: padded cumulative lengths, or None.
        cu_seqlens_q: actual cumulative lengths, or None.

    Returns:
        (cu_seqlens, name): the tensor to use and the name of the field it came from.
    """
    if cu_seqlens_q_padded is not None:
        return cu_seqlens_q_padded, CU_SEQLENS_Q_PADDED
    if cu_seqlens_q is not None:
        return cu_seqlens_q, CU_SEQLENS_Q
    raise InvalidPackedBoundaries(
        CU_SEQLENS_Q,
        "packed (thd) input carries neither cu_seqlens_q nor cu_seqlens_q_padded",
        "build PackedSeqParams with the cumulative sequence lengths of the packed batch",
    )


def full_sequence_length(local_length: int, sp_size: int = 1, cp_size: int = 1) -> int:
    """The packed length a GDN layer sees after the sequence-parallel gather.

    Args:
        local_length: the first dimension of the hidden states on this rank.
        sp_size: sequence-parallel size (the TP size when sequence parallelism is on, else 1).
        cp_size: context-parallel size.

    Returns:
        local_length * sp_size * cp_size, the length `cu_seqlens` must end at.
    """
    for key, value in (("local_length", local_length), ("sp_size", sp_size), ("cp_size", cp_size)):
        if (
            not isinstance(value, int)
            or isinstance(value, bool)
            or value < (0 if key == "local_length" else 1)
        ):
            raise ValueError(f"full_sequence_length: {key}={value!r} must be a positive integer")
    return local_length * sp_size * cp_size


@attrs.frozen(eq=False)
class PackedBoundaries:
    """A batch's packed boundaries, validated once: their values on the host and the tensor.

    Attributes:
        name: the field they came from (`cu_seqlens_q_padded` or `cu_seqlens_q`).
        values: the boundaries as Python ints, `[0, ..., T]`.
        tensor: the boundary tensor they were read from (layers use it by identity).
    """

    name: str
    values: tuple[int, ...]
    tensor: torch.Tensor

    @property
    def total_length(self) -> int:
        return self.values[-1]


def check_boundary_tensor(cu_seqlens: torch.Tensor, *, name: str = CU_SEQLENS_Q) -> None:
    """The checks a boundary tensor passes without reading its values: type, dtype, shape.

    Args:
        cu_seqlens: the boundaries, `[N + 1]`.
        name: the field the boundaries came from, for the error message.

    Returns:
        None. Raises InvalidPackedBoundaries.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise InvalidPackedBoundaries(name, f"expected a tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in _INTEGER_DTYPES:
        raise InvalidPackedBoundaries(
            name, f"dtype {cu_seqlens.dtype} is not an integer type", "pass int32 (or int64) boundaries"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise InvalidPackedBoundaries(
            name,
            f"shape {tuple(cu_seqlens.shape)} is not [num_sequences + 1] with at least one sequence",
            "pass a 1-D tensor [0, end_of_seq_0, ..., total]",
        )


def check_boundary_values(
    values: Sequence[int], *, total_length: int | None = None, name: str = CU_SEQLENS_Q, cp_size: int = 1
) -> None:
    """Check boundaries given as host integers (no tensor is read).

    Rules: starting at 0, non-decreasing (a zero-length sample is allowed), ending at
    `total_length` when given, and, with context parallelism, every sample length a multiple of
    `cp_size`.

    Args:
        values: the boundaries.
        total_length: the full packed length (see `full_sequence_length`), or None.
        name: the field the boundaries came from, for the error message.
        cp_size: context-parallel size.

    Returns:
        None. Raises InvalidPackedBoundaries.
    """
    if values[0] != 0:
        raise InvalidPackedBoundaries(name, f"starts at {values[0]}, not 0", "the first boundary must be 0")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise InvalidPackedBoundaries(
                name,
                f"decreases at index {i} ({values[i - 1]} -> {values[i]})",
                "boundaries are cumulative lengths and must be non-decreasing",
            )
    if total_length is not None and values[-1] != total_length:
        raise InvalidPackedBoundaries(
            name,
            f"ends at {values[-1]} but the packed sequence has {total_length} tokens "
            "(local length x sequence-parallel size x context-parallel size)",
            "pad the last sequence so the boundaries end at the packed length",
        )
    if cp_size > 1:
        bad = [b - a for a, b in itertools.pairwise(values) if (b - a) % cp_size]
        if bad:
            raise InvalidPackedBoundaries(
                name,
                f"sequence lengths {bad} are not multiples of context_parallel_size={cp_size}",
                "pad each sequence to a multiple of the context-parallel size",
            )


def validate_cu_seqlens(
    cu_seqlens: torch.Tensor, total_length: int, *, name: str = CU_SEQLENS_Q, cp_size: int = 1
) -> list[int]:
    """Check packed boundaries; reads them on the host once.

    Rules: a 1-D integer tensor with at least two entries (one sample), and the value rules of
    `check_boundary_values`.

    Args:
        cu_seqlens: the boundaries, `[N + 1]`.
        total_length: the full packed length (see `full_sequence_length`).
        name: the field the boundaries came from, for the error message.
        cp_size: context-parallel size.

    Returns:
        The boundaries as a list of Python ints.
    """
    check_boundary_tensor(cu_seqlens, name=name)
    values = [int(v) for v in cu_seqlens.tolist()]
    check_boundary_values(values, total_length=total_length, name=name, cp_size=cp_size)
    return values


def build_seq_idx(
    cu_seqlens: torch.Tensor, total_length: int, *, cu_seqlens_actual: torch.Tensor | None = None
) -> torch.Tensor:
    """The sample index of every token, without any device-to-host synchronization.

    The total is appended to the boundaries unconditionally, so tokens past the last boundary
    (if any) form one more sample and a boundary list that already ends at `total_length` just
    gets a zero-length tail. No Python branch ever looks at a tensor value.

    Args:
        cu_seqlens: the boundaries, `[N + 1]`, on any device (validated beforehand).
        total_length: the packed length `T` (a Python int, from a shape).
        cu_seqlens_actual: when given, the actual (unpadded) cumulative lengths: tokens of a
            padded slot beyond its sample's actual length get index -1 (the convention of the
            convolution kernels, which output zeros there).

    Returns:
        An int32 tensor `[1, T]` on the device of `cu_seqlens`.
    """
    device = cu_seqlens.device
    bounds = cu_seqlens.to(torch.int64)
    total = torch.full((1,), total_length, dtype=torch.int64, device=device)
    lengths = torch.diff(torch.cat([bounds, total]))
    index = torch.arange(lengths.numel(), dtype=torch.int32, device=device)
    seq_idx = torch.repeat_interleave(index, lengths, output_size=total_length)
    if cu_seqlens_actual is not None:
        actual_lengths = torch.diff(cu_seqlens_actual.to(torch.int64))
        # The appended tail has no actual tokens.
        actual_lengths = torch.cat([actual_lengths, torch.zeros_like(total)])
        sample = seq_idx.to(torch.int64)
        offset = torch.arange(total_length, dtype=torch.int64, device=device) - bounds.gather(
            0, sample.clamp(max=bounds.numel() - 1)
        )
        valid = offset < actual_lengths.gather(0, sample)
        seq_idx = torch.where(valid, seq_idx, torch.full_like(seq_idx, -1))
    return seq_idx.unsqueeze(0)


def sequence_starts(seq_idx: torch.Tensor) -> torch.Tensor:
    """Where a new sample begins, without device-to-host synchronization.

    Args:
        seq_idx: `[1, T]` (or `[T]`) sample indices from `build_seq_idx`.

    Returns:
        A bool tensor `[T]`: True at token 0 and wherever the sample index changes.
    """
    flat = seq_idx.reshape(-1)
    first = torch.ones(1, dtype=torch.bool, device=flat.device)
    return torch.cat([first, flat[1:] != flat[:-1]])[: flat.numel()]


def reject_packed_deterministic(deterministic_mode: bool, *, layer: str = "GatedDeltaNet") -> None:
    """Refuse packed input when Megatron-Core's deterministic mode is on.

    In deterministic mode Megatron-Core swaps GDN's kernels for a torch convolution and a torch
    chunked gated delta rule; neither knows about sequence boundaries, so packed samples would
    leak into each other.

    Args:
        deterministic_mode: `TransformerConfig.deterministic_mode`.
        layer: the layer's name, for the message.

    Returns:
        None; raises PackedGdnDeterministic when deterministic_mode is on.
    """
    if deterministic_mode:
        raise PackedGdnDeterministic(
            f"{layer}: packed (thd) sequences cannot run with deterministic_mode=True: the deterministic "
            "GDN fallback (torch conv1d and chunked gated delta rule) is not varlen-aware, so samples "
            f"would leak into each other. Set {config_key('te', 'deterministic_mode')}"
            "=false, or turn sequence packing off (padded bshd batches, e.g. use_remove_padding=false)."
        )
