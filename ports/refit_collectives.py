"""Port: the collectives a distributed refit needs besides the bucket streams."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from domain.refit.status import RankStatus
from ports.bucket_transport import BucketTransport


class RefitCollectives(Protocol):
    """Agreement, turn-taking and tensor-parallel exchanges among the ranks of a RefitWorld.

    Every call is collective over the ranks it names and bounded in time: a peer that does not
    answer makes it raise CollectiveTimeout naming this rank and `step`.
    """

    @property
    def rank(self) -> int:
        """This process's rank in the refit world."""
        ...

    @property
    def lead_bytes(self) -> int:
        """Bytes a packed bucket leaves free in front of its tensors for the transport's own
        record (0 when the transport needs none)."""
        ...

    @property
    def bucket_device(self) -> torch.device | None:
        """Where a source packs its buckets for the transport: the transport's device when its
        buckets must be there (the host for gloo: pinned when the tensors are on a GPU; the GPU
        for NCCL), or None: on the tensors' own device."""
        ...

    def agree(self, step: str, status: RankStatus) -> tuple[RankStatus, ...]:
        """Every rank's status at an agreement point (all ranks take part).

        Args:
            step: the agreement point, for errors (e.g. `staged`).
            status: this rank's status.

        Returns:
            All ranks' statuses, by rank.
        """
        ...

    def turn(self, source: int, step: str, failed: bool, next_index: int) -> tuple[bool, int]:
        """Open source `source`'s segment: its TP group and every engine take part.

        Args:
            source: the segment's source rank.
            step: for errors.
            failed: this rank already knows the refit failed (e.g. an engine's load failed).
            next_index: the index the segment's first bucket must carry (engines know it).

        Returns:
            (any participant failed, the largest next_index given).
        """
        ...

    def tp_exchange(
        self, holders: Sequence[int], step: str, failed: bool, amax: torch.Tensor
    ) -> tuple[bool, torch.Tensor]:
        """Among a TP group (`holders`, source first): whether any failed, and the largest amax.

        Args:
            holders: the ranks holding pieces of a unit.
            step: for errors (e.g. `export model.layers.0.self_attn.qkv`).
            failed: this rank failed (it stops after this exchange, and so do its peers).
            amax: this rank's float32 scalar amax (0 when it has none).

        Returns:
            (any holder failed, the maximum amax: exact, a maximum never rounds).
        """
        ...

    def tp_gather(
        self, holders: Sequence[int], step: str, piece: torch.Tensor, failed: bool
    ) -> tuple[bool, Sequence[torch.Tensor]]:
        """Gather the holders' flat uint8 pieces (all the same size) on the source, holders[0].

        Returns:
            (any holder failed, the pieces in TP-rank order on the source; empty elsewhere).
        """
        ...

    def transport(self, source: int, refit_id: int) -> BucketTransport:
        """The bucket transport from `source` to every engine rank, for refit `refit_id`."""
        ...
