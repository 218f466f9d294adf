"""The trainer side of a distributed refit: each rank exports the units it holds.

A source (tp_rank 0 of a stage / expert-parallel rank) turns its units into checkpoint tensors in
single-process order: a unit that one rank holds whole goes through `quantize_stream` as in a
single process; a TP-split unit runs, with the source's TP peers and in the same order on every
rank of the group:

1. an exchange (all-reduce MAX) of [failed, local amax]: the NVFP4 global scale comes from it;
2. local quantization of each shard ("local" mode) or nothing ("gather" mode: BF16 shards);
3. an exchange of [failed]: nobody gathers pieces that do not exist;
4. a gather of every rank's flattened pieces on the source, which concatenates them in TP order
   (and quantizes the gathered BF16 tensors in "gather" mode).

A failure on any rank of the group is seen by all of them at the next exchange, and they all stop
there. A source that stops for another reason (its transport failed) closes the group with a
failing exchange, so its peers never wait for a unit that will not come.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence

import attrs
import torch

from domain.errors import CollectiveTimeout, PeerFailed, PeerLost, ShardingError
from domain.quant.plan import QuantizationPlan
from domain.quant.stream import quantize_stream
from domain.refit.shard_map import ExportUnit, Placement, ShardMap
from domain.refit.shard_quant import (
    checkpoint_items,
    concat_shards,
    flatten_piece,
    global_scale_from_amax,
    local_amax,
    piece_nbytes,
    quantize_shard,
    unflatten_piece,
)
from ports.refit_collectives import RefitCollectives
from ports.sharded_trainer import ShardedTrainerModel

_ZERO = torch.zeros((), dtype=torch.float32)


@attrs.define
class _TpChannel:
    """The exchanges of one TP group during one refit; closed once any of them reports a failure."""

    comm: RefitCollectives
    holders: tuple[int, ...]
    open: bool = True

    def exchange(self, step: str, failed: bool, amax: torch.Tensor = _ZERO) -> tuple[bool, torch.Tensor]:
        if len(self.holders) < 2:
            return failed, amax
        try:
            any_failed, amax = self.comm.tp_exchange(self.holders, step, failed, amax)
        except (CollectiveTimeout, PeerLost):
            self.open = False  # the group is unusable: no closing exchange
            raise
        self.open = self.open and not any_failed
        return any_failed, amax

    def gather(self, step: str, piece: torch.Tensor) -> Sequence[torch.Tensor]:
        if len(self.holders) < 2:
            return [piece]
        try:
            return self.comm.tp_gather(self.holders, step, piece, False)[1]
        except (CollectiveTimeout, PeerLost):
            self.open = False
            raise

    def close(self, failed: bool) -> bool:
        """The group's last exchange (a no-op once closed); True when any rank failed."""
        if not self.open:
            return failed
        any_failed = self.exchange("end of export", failed)[0]
        self.open = False
        return any_failed


@attrs.define
class ShardExporter:
    """One trainer rank's part of the export.

    Attributes:
        plan: the quantization plan (the same on every rank).
        shard_map: placements and units.
        trainer: this rank's shards.
        comm: the collectives.
        where: the unit in progress, for errors.
        source_bytes: bytes of this rank's shards read so far.
    """

    plan: QuantizationPlan
    shard_map: ShardMap
    trainer: ShardedTrainerModel
    comm: RefitCollectives
    where: str = ""
    source_bytes: int = 0

    @property
    def rank(self) -> int:
        return self.comm.rank

    def _shard(self, p: Placement) -> torch.Tensor:
        t = self.trainer.local_weight(p.name)
        expected = p.shard_shape(self.rank)
        if tuple(t.shape) != expected:
            raise ShardingError(
                p.name, f"trainer rank {self.rank} holds shape {tuple(t.shape)}, the layout "
                f"{self.shard_map.layout.describe()} expects {expected}; check the parallel sizes"
            )
        self.source_bytes += t.numel() * t.element_size()
        return t

    def _tp_group(self, source: int) -> tuple[int, ...]:
        c = self.shard_map.layout.coords(source)
        return self.shard_map.layout.tp_ranks(c.stage, c.ep_rank)

    def _start(self, unit: ExportUnit) -> None:
        self.where = f"export {unit.name}"

    def stream(self, units: Sequence[ExportUnit]) -> Generator[tuple[str, torch.Tensor], None, None]:
        """On a source: its units' checkpoint tensors, in single-process order.

        Args:
            units: the source's segment (`ShardMap.segments()`), all with this rank as source.

        Returns:
            (checkpoint name, tensor) pairs. Close the generator when abandoning it: it then tells
            the TP peers to stop.
        """
        channel = _TpChannel(self.comm, self._tp_group(self.rank))
        finished = False
        try:
            for u in units:
                if u.is_split:
                    yield from self._split(u, channel)
                    continue
                self._start(u)
                yield from quantize_stream(self.plan, [(p.name, self._shard(p)) for p in u.members])
            self.where = "end of export"
            if channel.close(False):
                raise PeerFailed(f"rank {self.rank}: a TP peer of {list(channel.holders)} failed its export")
            finished = True
        finally:
            if not finished:
                channel.close(True)

    def serve(self, source: int, units: Sequence[ExportUnit]) -> None:
        """On a TP peer: take part in the split units of `source`'s segment, in order.

        Raises:
            PeerFailed: another rank of the group failed (its own error is reported by it).
        """
        channel = _TpChannel(self.comm, self._tp_group(source))
        split = [u for u in units if u.is_split and self.rank in u.holders]
        try:
            for u in split:
                for _ in self._split(u, channel):
                    pass
            self.where = "end of export"
            if channel.close(False):
                raise PeerFailed(f"rank {self.rank}: rank {source} or a TP peer failed the export")
        finally:
            channel.close(True)  # a no-op unless this rank stopped early

    def _split(self, u: ExportUnit, channel: _TpChannel) -> Iterator[tuple[str, torch.Tensor]]:
        step = f"export {u.name}"
        error: BaseException | None = None
        shards: list[torch.Tensor] = []
        amax = _ZERO
        try:
            self._start(u)
            shards = [self._shard(p) for p in u.members]
            if u.has_global_scale:
                amax = local_amax(shards)
                global_scale_from_amax(amax, u.name)  # NaN/Inf here fails this rank, named
        except Exception as err:
            error = err
        failed, amax = channel.exchange(step, error is not None, amax)
        self._stop(u, error, failed)
        gs = global_scale_from_amax(amax, u.name, self.plan.numerics) if u.has_global_scale else None
        pieces: list[dict[str, torch.Tensor]] = []
        try:
            for shard, d, mode in zip(shards, u.decisions, u.modes, strict=True):
                pieces.append(quantize_shard(self.plan, d, shard, gs) if mode == "local" else {"weight": shard})
            flat = torch.cat([flatten_piece(p) for p in pieces])
        except Exception as err:
            error = err
        failed, _ = channel.exchange(f"{step} (quantized)", error is not None)
        self._stop(u, error, failed)
        gathered = channel.gather(f"{step} (gather)", flat)
        if self.rank != u.source:
            return
        yield from self._assemble(u, pieces, gathered, gs)

    def _stop(self, u: ExportUnit, error: BaseException | None, failed: bool) -> None:
        if error is not None:
            raise error
        if failed:
            raise PeerFailed(f"rank {self.rank}: a peer of TP group {list(u.holders)} failed exporting {u.name}")

    def _assemble(self, u: ExportUnit, mine: list[dict[str, torch.Tensor]], gathered: Sequence[torch.Tensor],
                  gs: torch.Tensor | None) -> Iterator[tuple[str, torch.Tensor]]:
        sizes = [piece_nbytes(p) for p in mine]
        per_rank = []
        for flat in gathered:
            parts, off = [], 0
            for like, n in zip(mine, sizes, strict=True):
                parts.append(unflatten_piece(flat[off : off + n], like))
                off += n
            per_rank.append(parts)
        for j, (p, d, mode) in enumerate(zip(u.members, u.decisions, u.modes, strict=True)):
            full = concat_shards([parts[j] for parts in per_rank], p.split_dim or 0, p.name, p.sections)
            if mode == "gather" and d.is_quantized:
                full = quantize_shard(self.plan, d, full["weight"], gs)
            yield from checkpoint_items(self.plan, d, full)
