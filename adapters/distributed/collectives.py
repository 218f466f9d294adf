"""The collectives of a refit world over torch.distributed: gloo on CPU, NCCL on GPU.

TorchDistCollectives builds every process group a refit world needs (all ranks call it in the same
order) and runs the agreement, turn and tensor-parallel collectives; it hands out one
TorchDistTransport (adapters.distributed.transport) per source. Every wait is bounded: a silent
peer raises CollectiveTimeout naming this rank and the step.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import attrs
import torch

try:
    import torch.distributed as dist
except ImportError as err:  # pragma: no cover - torch built without distributed support
    raise ModuleNotFoundError("TorchDistCollectives needs torch.distributed", name="torch.distributed") from err
if not dist.is_available():  # pragma: no cover
    raise ModuleNotFoundError("TorchDistCollectives needs torch.distributed (this torch build lacks it)",
                              name="torch.distributed")

from adapters.distributed.transport import TorchDistTransport, wait_work
from adapters.distributed.wire import LEAD_BYTES, STATUS_BYTES, decode_status, encode_status
from domain.refit.status import RankStatus
from domain.refit.topology import RefitWorld

_STATUS_PAD = 16  # bytes in front of a gathered piece: its holder's failure flag


def backend_device(backend: str) -> torch.device:
    """Where a process group's tensors must live: this rank's current GPU for NCCL, else the host."""
    return torch.device("cuda", torch.cuda.current_device()) if backend.lower() == "nccl" else torch.device("cpu")


@attrs.define
class TorchDistCollectives:
    """RefitCollectives over torch.distributed: the process groups of one RefitWorld.

    Construct it on every rank, in the same order relative to other group creations: it creates
    the world group, one TP group per (stage, ep_rank), and per source a broadcast group
    ({source} + engines) and a turn group (its TP group + engines).

    Attributes:
        world: the refit world (layout and engine count).
        rank: this process's rank.
        step_timeout_s: bound on every per-bucket and tensor-parallel wait.
        phase_timeout_s: bound on waits that include other ranks' work (turns, agreement).
        bucket_bytes: receive buffer capacity.
        window: buckets in flight per stream (2 = double buffering).
        device: where every tensor of the world's collectives and streams lives: None (the
            default) follows the default world's backend: the host for gloo, this rank's current
            GPU for NCCL (which sends only GPU tensors).
    """

    world: RefitWorld
    rank: int
    step_timeout_s: float = 60.0
    phase_timeout_s: float = 600.0
    bucket_bytes: int = 64 << 20
    window: int = 2
    device: torch.device | None = attrs.field(default=None, converter=attrs.converters.optional(torch.device))
    _groups: dict[tuple[int, ...], Any] = attrs.field(init=False, factory=dict)
    _transports: dict[int, TorchDistTransport] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("TorchDistCollectives: call torch.distributed.init_process_group first")
        if dist.get_world_size() != self.world.size:
            raise ValueError(
                f"the process group has {dist.get_world_size()} ranks but the refit world needs {self.world.size} "
                f"({self.world.layout.describe()}, {self.world.engines} engines)"
            )
        if self.device is None:
            self.device = backend_device(str(dist.get_backend()))
        timeout = datetime.timedelta(seconds=max(self.step_timeout_s, self.phase_timeout_s))
        layout, engines = self.world.layout, self.world.engine_ranks
        wanted = [tuple(range(self.world.size))]
        for stage in range(layout.pp):
            for ep_rank in range(layout.ep):
                tp = layout.tp_ranks(stage, ep_rank)
                wanted += [tp, (tp[0], *engines), (*tp, *engines)]
        for ranks in wanted:
            if ranks not in self._groups:  # the same order on every rank
                self._groups[ranks] = dist.new_group(list(ranks), timeout=timeout)

    @property
    def _device(self) -> torch.device:
        return self.device if self.device is not None else torch.device("cpu")  # resolved at construction

    @property
    def bucket_device(self) -> torch.device:
        """Packed buckets are made where the streams run (pinned on the host for a GPU trainer over gloo)."""
        return self._device

    def _group(self, ranks: Sequence[int]) -> Any:
        return self._groups[tuple(ranks)]

    @property
    def lead_bytes(self) -> int:
        """Room for the lead record in front of each packed bucket: one message per bucket."""
        return LEAD_BYTES

    def agree(self, step: str, status: RankStatus) -> tuple[RankStatus, ...]:
        ranks = tuple(range(self.world.size))
        out = [torch.empty(STATUS_BYTES, dtype=torch.uint8, device=self._device) for _ in ranks]
        work = dist.all_gather(out, encode_status(status).to(self._device), group=self._group(ranks), async_op=True)
        wait_work(work, self.rank, f"agreement: {step}", self.phase_timeout_s, ranks)
        return tuple(decode_status(t) for t in out)

    def turn(self, source: int, step: str, failed: bool, next_index: int) -> tuple[bool, int]:
        layout = self.world.layout
        c = layout.coords(source)
        ranks = (*layout.tp_ranks(c.stage, c.ep_rank), *self.world.engine_ranks)
        t = torch.tensor([int(failed), next_index], dtype=torch.int64, device=self._device)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group(ranks), async_op=True)
        wait_work(work, self.rank, step, self.phase_timeout_s, ranks)
        return bool(t[0]), int(t[1])

    def tp_exchange(self, holders: Sequence[int], step: str, failed: bool, amax: torch.Tensor) -> tuple[bool, torch.Tensor]:
        t = torch.tensor([float(failed), float(amax)], dtype=torch.float64, device=self._device)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group(holders), async_op=True)
        wait_work(work, self.rank, step, self.step_timeout_s, holders)
        return bool(t[0] > 0), t[1].to(device=amax.device, dtype=torch.float32)

    def tp_gather(self, holders: Sequence[int], step: str, piece: torch.Tensor, failed: bool) -> tuple[bool, list[torch.Tensor]]:
        send = torch.zeros(_STATUS_PAD + piece.numel(), dtype=torch.uint8, device=self._device)
        send[0] = int(failed)
        send[_STATUS_PAD:] = piece
        source = holders[0]
        gather = [torch.empty_like(send) for _ in holders] if self.rank == source else None
        work = dist.gather(send, gather, dst=source, group=self._group(holders), async_op=True)
        wait_work(work, self.rank, step, self.step_timeout_s, holders)
        if gather is None:
            return failed, []
        return failed or any(bool(g[0]) for g in gather), [g[_STATUS_PAD:].to(piece.device) for g in gather]

    def bound(self, step_timeout_s: float, phase_timeout_s: float) -> None:
        """Set the waits' bounds for the refits that follow, e.g. tighter ones once a run's first
        refit (its layout exchange, the first quantization, cold caches) is done. The process
        groups keep the timeout they were made with, the larger of the first bounds."""
        self.step_timeout_s, self.phase_timeout_s = step_timeout_s, phase_timeout_s
        for t in self._transports.values():
            t.timeout_s = step_timeout_s

    def transport(self, source: int, refit_id: int) -> TorchDistTransport:
        t = self._transports.get(source)
        if t is None:
            ranks = (source, *self.world.engine_ranks)
            t = TorchDistTransport(
                self._group(ranks), source, self.rank, ranks, refit_id, self.bucket_bytes,
                self.step_timeout_s, self.window, self._device,
            )
            self._transports[source] = t  # receive buffers are kept from one refit to the next
        t.refit_id = refit_id
        return t
