"""THD packing: variable-length sequences in one [total_tokens, ...] tensor
(docs/thd-packing.md#the-layout).

Each sequence is padded to a multiple of the per-sequence alignment

    align = lcm(recipe alignment, tp * cp * (2 if cp > 1 else 1))

(quantized GEMMs need row counts that are multiples of the recipe alignment; tensor and
context parallelism split every sequence into tp * cp, or 2 * tp * cp load-balanced, pieces).
The packed total is then padded to a multiple of align * 128, and that extra padding goes on the
last sequence. `cu_seqlens` counts real tokens, `cu_seqlens_padded` the offsets in the pack.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

from domain.errors import ThdPackingError

# Row alignment of quantized GEMMs per training recipe, used when Megatron-Core is not there to
# ask (`get_fp8_align_size` / `get_fp4_align_size`). None means no quantized recipe (BF16).
RECIPE_ALIGNMENT: dict[str | None, int] = {
    None: 1,
    "delayed": 16,
    "tensorwise": 16,
    "blockwise": 16,
    "mxfp8": 32,
    "nvfp4": 128,  # Megatron-Core 0.19's get_fp4_align_size (32 is the TMA minimum)
}
TOTAL_ALIGN_FACTOR = 128


def recipe_alignment(recipe: str | None) -> int:
    """Row alignment a training recipe needs, from the documented table.

    Args:
        recipe: "delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4", or None for BF16.

    Returns:
        The alignment in tokens.

    Raises:
        ThdPackingError: the recipe is not in the table (e.g. "custom"): pass the alignment.
    """
    key = recipe.lower() if isinstance(recipe, str) else recipe
    if key not in RECIPE_ALIGNMENT:
        known = ", ".join(sorted(str(k) for k in RECIPE_ALIGNMENT if k))
        raise ThdPackingError(
            f"no known row alignment for training recipe {recipe!r} (known: {known}); "
            "pass the alignment explicitly"
        )
    return RECIPE_ALIGNMENT[key]


def sequence_alignment(recipe_align: int, tp: int = 1, cp: int = 1) -> int:
    """Per-sequence alignment: lcm(recipe_align, tp * cp * (2 if cp > 1 else 1)).

    Args:
        recipe_align: the recipe's row alignment (1 for BF16).
        tp: tensor-parallel size.
        cp: context-parallel size.

    Returns:
        The alignment in tokens.
    """
    for name, v in (("recipe alignment", recipe_align), ("tp", tp), ("cp", cp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ThdPackingError(f"{name} must be a positive integer, got {v!r}")
    return math.lcm(recipe_align, tp * cp * (2 if cp > 1 else 1))


def _int_tuple(values: Sequence[int]) -> tuple[int, ...]:
    return tuple(values)


def _positive_lengths(_: object, attribute: attrs.Attribute, value: tuple[int, ...]) -> None:
    if not value:
        raise ThdPackingError(f"{attribute.name}: no sequences to pack")
    bad = [n for n in value if isinstance(n, bool) or not isinstance(n, int) or n < 1]
    if bad:
        raise ThdPackingError(f"{attribute.name}: lengths must be integers >= 1, got {bad[:5]}")


@attrs.frozen
class ThdLayout:
    """Where each sequence sits in a THD pack.

    Attributes:
        seqlens: real token count of each sequence.
        padded_seqlens: each sequence's slot in the pack (the last one holds the extra padding).
        align: the per-sequence alignment the layout was planned with.
    """

    seqlens: tuple[int, ...] = attrs.field(converter=_int_tuple, validator=_positive_lengths)
    padded_seqlens: tuple[int, ...] = attrs.field(converter=_int_tuple)
    align: int = 1

    @padded_seqlens.validator
    def _check_padded(self, _: attrs.Attribute, value: tuple[int, ...]) -> None:
        if len(value) != len(self.seqlens) or any(p < n for p, n in zip(value, self.seqlens, strict=True)):
            raise ThdPackingError(
                f"padded_seqlens {value[:5]} do not cover seqlens {self.seqlens[:5]} one to one"
            )

    @classmethod
    def plan(
        cls, seqlens: Sequence[int], align: int, *, total_multiple: int | None = None
    ) -> ThdLayout:
        """Pad each length to `align`, then the total to `total_multiple` on the last sequence.

        Args:
            seqlens: real token counts, each >= 1.
            align: per-sequence alignment (see `sequence_alignment`).
            total_multiple: what the total must divide by; default align * 128.

        Returns:
            The layout.
        """
        if isinstance(align, bool) or not isinstance(align, int) or align < 1:
            raise ThdPackingError(f"align must be a positive integer, got {align!r}")
        lengths = tuple(seqlens)
        _positive_lengths(None, attrs.fields(cls).seqlens, lengths)
        multiple = align * TOTAL_ALIGN_FACTOR if total_multiple is None else total_multiple
        if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
            raise ThdPackingError(f"total_multiple must be a positive integer, got {multiple!r}")
        padded = [-(-n // align) * align for n in lengths]
        total = sum(padded)
        padded[-1] += -(-total // multiple) * multiple - total
        return cls(lengths, tuple(padded), align)

    @property
    def total(self) -> int:
        """Tokens in the pack, padding included."""
        return sum(self.padded_seqlens)

    @property
    def max_seqlen(self) -> int:
        """Longest padded slot (what attention kernels take as max_seqlen)."""
        return max(self.padded_seqlens)

    @property
    def cu_seqlens(self) -> tuple[int, ...]:
        """Cumulative real lengths, starting at 0."""
        return _cumulative(self.seqlens)

    @property
    def cu_seqlens_padded(self) -> tuple[int, ...]:
        """Offsets of each sequence in the pack, starting at 0 and ending at `total`."""
        return _cumulative(self.padded_seqlens)

    def cu_seqlens_tensor(self, *, padded: bool, device: torch.device | str = "cpu") -> torch.Tensor:
        """`cu_seqlens` (or `cu_seqlens_padded`) as int32, as attention kernels take it."""
        values = self.cu_seqlens_padded if padded else self.cu_seqlens
        return torch.tensor(values, dtype=torch.int32, device=device)

    def token_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Bool [total]: True on real tokens, False on padding."""
        mask = torch.zeros(self.total, dtype=torch.bool, device=device)
        for start, n in zip(self.cu_seqlens_padded, self.seqlens, strict=False):
            mask[start : start + n] = True
        return mask

    def position_ids(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Int64 [total]: position of each token within its sequence; 0 on padding.

        Padding gets 0 so that a learned position table is never indexed past the longest
        real sequence (the last slot can be much longer than its sequence).
        """
        pos = torch.zeros(self.total, dtype=torch.long, device=device)
        for start, n in zip(self.cu_seqlens_padded, self.seqlens, strict=False):
            pos[start : start + n] = torch.arange(n, device=device)
        return pos

    def pack(self, sequences: Sequence[torch.Tensor], pad_value: float | int = 0) -> torch.Tensor:
        """Concatenate sequences [L_i, ...] into [total, ...], padding each slot with `pad_value`.

        Args:
            sequences: one tensor per sequence, first dimension its real length.
            pad_value: value of padding positions.

        Returns:
            The packed tensor, dtype and device of the first sequence.
        """
        if len(sequences) != len(self.seqlens):
            raise ThdPackingError(f"got {len(sequences)} sequences for a layout of {len(self.seqlens)}")
        first = sequences[0]
        out = torch.full((self.total, *first.shape[1:]), pad_value, dtype=first.dtype, device=first.device)
        for i, (seq, start) in enumerate(zip(sequences, self.cu_seqlens_padded, strict=False)):
            if seq.shape[0] != self.seqlens[i] or seq.shape[1:] != first.shape[1:]:
                raise ThdPackingError(
                    f"sequence {i} has shape {tuple(seq.shape)}, expected ({self.seqlens[i]}, "
                    f"{', '.join(map(str, first.shape[1:]))}) from the layout"
                )
            out[start : start + seq.shape[0]] = seq
        return out

    def unpack(self, packed: torch.Tensor, *, drop_last: bool = False) -> list[torch.Tensor]:
        """Split [total, ...] back into the real tokens of each sequence.

        Args:
            packed: a tensor laid out by this layout (e.g. per-token log-probs).
            drop_last: also drop each sequence's last token (next-token scores have none there).

        Returns:
            One tensor per sequence, [L_i, ...] (or [L_i - 1, ...] with drop_last); views.
        """
        self._check_packed(packed)
        cut = 1 if drop_last else 0
        return [
            packed[start : start + n - cut]
            for start, n in zip(self.cu_seqlens_padded, self.seqlens, strict=False)
        ]

    def unpack_padded(
        self, packed: torch.Tensor, *, fill: float = 0.0, drop_last: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sequence rows [B, max_len, ...] with padding set to `fill`, and the bool mask [B, max_len].

        Args:
            packed: a tensor laid out by this layout.
            fill: value written where a row has no token.
            drop_last: as in `unpack`.

        Returns:
            (values, mask): mask is True where values hold a real token.
        """
        parts = self.unpack(packed, drop_last=drop_last)
        width = max(p.shape[0] for p in parts)
        out = torch.full((len(parts), width, *packed.shape[1:]), fill, dtype=packed.dtype, device=packed.device)
        mask = torch.zeros(len(parts), width, dtype=torch.bool, device=packed.device)
        for i, p in enumerate(parts):
            out[i, : p.shape[0]] = p
            mask[i, : p.shape[0]] = True
        return out, mask

    def next_token_labels(self, packed_ids: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Labels for next-token scoring inside each sequence: position t gets token t + 1.

        The last real token of each sequence and all padding get `ignore_index`, so no score
        crosses a sequence boundary.

        Args:
            packed_ids: int [total] packed token ids.
            ignore_index: label of positions that are not scored.

        Returns:
            Int [total] labels.
        """
        self._check_packed(packed_ids)
        labels = torch.full_like(packed_ids, ignore_index)
        for start, n in zip(self.cu_seqlens_padded, self.seqlens, strict=False):
            labels[start : start + n - 1] = packed_ids[start + 1 : start + n]
        return labels

    def _check_packed(self, packed: torch.Tensor) -> None:
        if packed.dim() == 0 or packed.shape[0] != self.total:
            raise ThdPackingError(
                f"packed tensor has {packed.shape[0] if packed.dim() else 0} rows, the layout has "
                f"{self.total}; unpack with the layout the tensor was packed with"
            )


def _cumulative(lengths: Sequence[int]) -> tuple[int, ...]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return tuple(out)
