"""A source that breaks the wire format on purpose, and the rank program that runs it.

Both ranks run the real DistributedRefitService (trainer rank 0, engine rank 1). On rank 0 the
collectives hand the service a BadSender instead of the real transport: it drains the real
bucket stream (the exporter runs as usual) and broadcasts crafted frames instead, built with the
wire module's own encoders, over the same gloo group. It sends exactly the messages the receiver
posts receives for up to the point where the receiver must refuse the stream, so a correct
receiver ends the refit through the agreement, and an incorrect one crashes, hangs or accepts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import torch

from adapters.distributed.wire import FrameKind, Header, encode_control, encode_lead, encode_metas
from domain.refit.buckets import Bucket
from domain.refit.status import TransferStats
from tests.distributed import support

# name -> (the stream the bad source sends, the receiver's WireProtocolError must say)
LEARNING = {
    "oversized": "above the",  # a claimed 1 TiB bucket
    "oversized_metadata": "bytes of metadata",  # a claimed 1 TiB of metadata
    "negative": "negative size",
    "out_of_order": "out of order",
    "after_last": "after the bucket it marked last",
    "size_mismatch": "its tensors occupy",  # the header's size disagrees with its tensors
    "sends_more": "sent more than",  # announces N bytes, sends N + 4096
    "sends_less": "sent fewer than",  # announces N bytes, sends N - 512
}
# The same faults once both ends know the stream layout (a good refit first, lead records then).
KNOWN = {
    "known_out_of_order": "out of order",
    "known_size": "its stream layout has",
    "known_sends_more": "sent more than",
}


def _keep(b: Bucket) -> Bucket:
    """A bucket with bytes of its own (the planner reuses its buffers for later buckets)."""
    return Bucket(b.index, b.buffer[: b.nbytes].clone(), b.metas, b.is_last)


@attrs.define
class BadSender:
    """Sends `scenario` over the real transport's group in place of the bucket stream."""

    real: Any
    scenario: str

    @property
    def window(self) -> int:
        return self.real.window

    def _control(self, header: Header, body: torch.Tensor) -> list[torch.Tensor]:
        control, rest = encode_control(header, body)
        return [control] if rest is None else [control, rest]

    def _frames(self, first: Bucket, second: Bucket | None) -> list[torch.Tensor]:
        rid, meta = self.real.refit_id, encode_metas(first.metas)
        data = first.buffer[: first.nbytes]
        bucket = Header(FrameKind.BUCKET, rid, first.index, False, first.nbytes, meta.numel())
        end = self._control(Header(FrameKind.END, rid, 1), torch.empty(0, dtype=torch.uint8))
        s = self.scenario
        if s == "oversized":
            return self._control(attrs.evolve(bucket, nbytes=1 << 40), meta)
        if s == "oversized_metadata":
            return self._control(attrs.evolve(bucket, meta_len=1 << 40), meta)
        if s == "negative":
            return self._control(attrs.evolve(bucket, nbytes=-5), meta)
        if s == "size_mismatch":
            return self._control(attrs.evolve(bucket, nbytes=first.nbytes + 256), meta)
        if s == "out_of_order":
            return [*self._control(bucket, meta), data, *self._control(attrs.evolve(bucket, index=first.index + 2), meta)]
        if s == "after_last":
            assert second is not None
            nxt = Header(FrameKind.BUCKET, rid, second.index, False, second.nbytes, encode_metas(second.metas).numel())
            return [*self._control(attrs.evolve(bucket, is_last=True), meta), data,
                    *self._control(nxt, encode_metas(second.metas))]
        if s == "sends_more":
            return [*self._control(bucket, meta), torch.cat([data, torch.full((4096,), 7, dtype=torch.uint8)]), *end]
        if s == "sends_less":
            return [*self._control(bucket, meta), data[:-512].clone(), *end]
        return self._known(first, second)

    def _known(self, first: Bucket, second: Bucket | None) -> list[torch.Tensor]:
        """The first buckets of a known layout, one of them with a bad lead record or payload."""
        if self.scenario == "known_out_of_order":  # bucket 0 is fine, bucket 1 claims index 4
            assert second is not None
            return [*self._lead_message(first), *self._lead_message(second, index=second.index + 3)]
        if self.scenario == "known_size":
            return self._lead_message(first, nbytes=first.nbytes - 256)
        frames = self._lead_message(first)
        frames[-1] = torch.cat([frames[-1], torch.full((4096,), 7, dtype=torch.uint8)])  # known_sends_more
        return frames

    def _lead_message(self, b: Bucket, **changes: int) -> list[torch.Tensor]:
        """A bucket of the known layout as the real transport sends it, with header `changes`."""
        layout = self.real._layout
        assert layout is not None, "a known-layout scenario needs a good refit first"
        header = Header(FrameKind.BUCKET, self.real.refit_id, b.index, b.is_last, b.nbytes, layout=layout.digest)
        lead, data = encode_lead(attrs.evolve(header, **changes)), b.buffer[: b.nbytes]
        if b.metas and b.metas[0].offset >= lead.numel():  # the lead record rides in front of the data
            data = data.clone()
            data[: lead.numel()] = lead
            return [data]
        return [lead, data]

    def send(self, buckets: Iterable[Bucket]) -> TransferStats:
        kept = []
        for b in buckets:  # the exporter runs to the end; the first two buckets are kept
            if len(kept) < 2:
                kept.append(_keep(b))
        frames = self._frames(kept[0], kept[1] if len(kept) > 1 else None)
        import torch.distributed as dist

        works = [dist.broadcast(t, self.real.source, group=self.real.group, async_op=True) for t in frames]
        for w in works:
            w.wait()
        return TransferStats(buckets=len(kept))


class _Comm:
    """The collectives, with the bad sender in place of this rank's transport (when armed)."""

    def __init__(self, comm: Any) -> None:
        self._comm, self.scenario = comm, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def transport(self, source: int, refit_id: int) -> Any:
        real = self._comm.transport(source, refit_id)
        return BadSender(real, self.scenario) if self.scenario is not None else real


def bad_peer_rank(rank: int, scenarios: list[str]) -> list[dict[str, Any]]:
    """Per scenario, on fresh process groups: a good refit first for known-layout scenarios,
    then one refit whose stream rank 0 corrupts. Returns, per scenario, what this rank raised
    and (engine) whether its live weights stayed those of before the bad refit."""
    from adapters.distributed.collectives import TorchDistCollectives
    from domain.refit.topology import RefitWorld

    world = RefitWorld()
    p = support.plan("FP8_BLOCK", "NVFP4")
    out = []
    for scenario in scenarios:
        comm = _Comm(TorchDistCollectives(world, rank, step_timeout_s=60, phase_timeout_s=60,
                                          bucket_bytes=int(support.BUCKET_MB * 2**20)))
        full = support.trainer_at(0) if rank == 0 else None
        engine = support._engine(p, "transactional") if rank == 1 else None
        svc = support._service(world, rank, comm, p, full, engine, None)
        if scenario.startswith("known_"):
            svc.refit()
        before = support.digest(dict(engine.live_weights())) if engine is not None and scenario.startswith("known_") else None
        comm.scenario = scenario if rank == 0 else None
        record: dict[str, Any] = {"scenario": scenario}
        try:
            svc.refit()
            record["raised"] = None
        except Exception as err:
            record.update(raised=type(err).__name__, text=str(err))
        if engine is not None and before is not None:
            record["kept"] = support.digest(dict(engine.live_weights())) == before
            record["stale"] = engine.is_stale
        out.append(record)
    return out
