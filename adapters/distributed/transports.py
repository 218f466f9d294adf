"""Every bucket transport by name, on both ends: what a weight-transfer backend calls to build the
stream between a trainer and an engine's workers in other processes (docs/engines.md, "Transports").

Sender side, two steps (the receivers join in between):

    offer = offer_transport("cuda_ipc", receivers=2, bucket_bytes=64 << 20, device="cuda:0")
    ... hand offer.rendezvous (plain data) to every worker, which calls join_transport ...
    link = offer.accept()            # blocks until every receiver has joined
    link.transport.send(buckets)     # one refit's stream; link.close() at the end

Receiver side (in each worker):

    link = join_transport("cuda_ipc", rendezvous, rank=1, bucket_bytes=64 << 20)
    link.transport.receive(consume)

`shm` and `cuda_ipc` receivers return at once (the source's socket queues them); `gloo` and
`nccl` receivers block until every member has joined, as the sender's `accept` does, so the
sender must hand out the rendezvous before it accepts. Names come from
domain.refit.transport_choice (resolve `auto` there first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from domain.errors import ConfigError
from domain.refit.transport_choice import TRANSPORTS


@attrs.frozen
class TransportLink:
    """One end of a stream: its transport (a BucketTransport) and what closes it.

    Attributes:
        transport: the BucketTransport (`send` on the source, `receive` on a receiver).
        closer: the object whose `close()` ends the link (the ring's transport, or the side group).
    """

    transport: Any
    closer: Any

    def close(self) -> None:
        self.closer.close()


@attrs.frozen
class TransportOffer:
    """The sender's end before its receivers have joined.

    Attributes:
        name: the transport.
        rendezvous: plain data for every receiver's `join_transport`.
        accept: waits for every receiver and returns the sender's link.
        close: gives up before accepting (removes what `offer_transport` made).
    """

    name: str
    rendezvous: dict[str, Any]
    accept: Callable[[], TransportLink]
    close: Callable[[], None]


def _check(name: str) -> None:
    if name not in TRANSPORTS:
        raise ConfigError("transport", f"no transport named {name!r}; use one of {', '.join(TRANSPORTS)} "
                          "(resolve auto with domain.refit.transport_choice.choose_transport first)")


def offer_transport(name: str, receivers: int, bucket_bytes: int, *, device: torch.device | str | None = None,
                    timeout_s: float = 60.0, host: str = "127.0.0.1", slot_bytes: int = 32 << 20) -> TransportOffer:
    """The sender's end of transport `name` for `receivers` receivers.

    Args:
        name: shm, gloo, nccl or cuda_ipc.
        receivers: how many receivers will join (ranks 1..receivers).
        bucket_bytes: the agreed bucket capacity.
        device: cuda_ipc: the GPU the ring is allocated on (default: the current one).
        timeout_s: bound on joining and on every wait of a stream.
        host: gloo, nccl: the address the side group's store listens on.
        slot_bytes: shm: bytes of each of the ring's slots (at most a bucket).

    Returns:
        A TransportOffer. Raises ConfigError naming the key for an unknown name.
    """
    _check(name)
    if name == "shm":
        from adapters.distributed.shm_transport import ShmSource

        ring = ShmSource.serve(receivers, slot_bytes=min(bucket_bytes, slot_bytes), timeout_s=timeout_s)
        return TransportOffer(name, ring.rendezvous.to_dict(), lambda: _ring_link(ring.accept()), ring.close)
    if name == "cuda_ipc":
        from adapters.distributed.cuda_ipc_transport import CudaIpcSource

        where = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        ipc = CudaIpcSource.serve(receivers, bucket_bytes, where, timeout_s=timeout_s)
        return TransportOffer(name, ipc.rendezvous.to_dict(), lambda: _ring_link(ipc.accept()), ipc.close)
    from adapters.distributed.side_group import SideGroup

    rv, store = SideGroup.serve(host, 1 + receivers, backend=name, timeout_s=timeout_s)

    def accept() -> TransportLink:
        group = SideGroup.join(rv, 0, store)
        return TransportLink(_dist_transport(group, 0, bucket_bytes, timeout_s, window=1), group)

    return TransportOffer(name, rv.to_dict(), accept, lambda: None)


def join_transport(name: str, rendezvous: dict[str, Any], rank: int, bucket_bytes: int) -> TransportLink:
    """A receiver's end of transport `name` (see the module's docstring for which ones block).

    Args:
        name: the sender's transport.
        rendezvous: the sender's `TransportOffer.rendezvous`.
        rank: this receiver's rank, 1..receivers.
        bucket_bytes: the agreed bucket capacity.

    Returns:
        The receiver's TransportLink.
    """
    _check(name)
    if name == "shm":
        from adapters.distributed.shm_transport import ShmRendezvous, connect

        return _ring_link(connect(ShmRendezvous.from_dict(rendezvous), rank, bucket_bytes))
    if name == "cuda_ipc":
        from adapters.distributed.cuda_ipc_transport import CudaIpcRendezvous
        from adapters.distributed.cuda_ipc_transport import connect as connect_ipc

        return _ring_link(connect_ipc(CudaIpcRendezvous.from_dict(rendezvous), rank, bucket_bytes))
    from adapters.distributed.side_group import Rendezvous, SideGroup

    rv = Rendezvous.from_dict(rendezvous)
    group = SideGroup.join(rv, rank)
    return TransportLink(_dist_transport(group, rank, bucket_bytes, rv.timeout_s), group)


def _ring_link(transport: Any) -> TransportLink:
    return TransportLink(transport, transport)


def _dist_transport(group: Any, rank: int, bucket_bytes: int, timeout_s: float, window: int = 2) -> Any:
    from adapters.distributed.transport import TorchDistTransport

    return TorchDistTransport(group, source=0, rank=rank, peers=group.ranks, bucket_bytes=bucket_bytes,
                              timeout_s=timeout_s, window=window, device=group.device)
