"""A bucket transport through CUDA IPC, for a GPU trainer and an engine's workers on the same GPUs.

The shape of the colocated GPU refits of verl, NeMo-RL and SkyRL, and of vLLM's own `ipc` weight
transfer: the source allocates a ring of `slots` slots (2: a double buffer) on its GPU, and every
receiver maps it once, through a CUDA IPC handle, when it connects. Everything else is the
shared-memory ring's (adapters.distributed.shm_transport): the same Unix socket per receiver, the
same frames ("filled" notices, "consumed" acknowledgements), the same failure reports. What CUDA
adds is ordering: the source's copy into a slot runs on its GPU stream, so the source waits for it
before it announces the slot; a receiver's consumer copies out of the slot on its own stream, so
the receiver waits for that before it releases the slot.

Setup: `CudaIpcSource.serve` allocates the ring, listens on a socket in Linux's abstract namespace
(no file: nothing is left on disk when the source dies), and returns a `CudaIpcRendezvous` (plain
data: the socket's name, the ring's size and its IPC handle); each receiver's `connect` maps the
ring and connects; `accept` takes them all and returns the source's transport. How the handle is
made and mapped is a `RingSharing`: `IPC_SHARING` (CUDA IPC, between processes) by default; tests
on a CPU pass one that hands over the tensor in-process.
"""

from __future__ import annotations

import base64
import pickle
from typing import Any, Protocol

import attrs
import torch

from adapters.distributed.shm_transport import (
    _CHUNK,
    ShmRendezvous,
    ShmSource,
    ShmTransport,
    dial,
    fresh_name,
    listen,
)

DEFAULT_SLOTS = 2


class RingSharing(Protocol):
    """How a ring on a GPU is handed to other processes: `export` on the source, `open` on each receiver."""

    def export(self, ring: torch.Tensor) -> str:
        """A text handle for `ring` (it travels in a control message)."""
        ...

    def open(self, handle: str) -> torch.Tensor:
        """The ring the handle names, mapped in this process."""
        ...


def _uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


@attrs.frozen
class CudaIpcSharing:
    """RingSharing through CUDA IPC handles (torch.multiprocessing's reductions). The handle names
    the GPU by its UUID, so a receiver that sees the GPUs under other indices (its own
    CUDA_VISIBLE_DEVICES) maps the same device."""

    def export(self, ring: torch.Tensor) -> str:
        from torch.multiprocessing.reductions import reduce_tensor

        rebuild, args = reduce_tensor(ring)
        return base64.b64encode(pickle.dumps((rebuild, args, _uuid(ring.device.index or 0)))).decode()

    def open(self, handle: str) -> torch.Tensor:
        rebuild, args, uuid = pickle.loads(base64.b64decode(handle))
        local = [i for i in range(torch.cuda.device_count()) if _uuid(i) == uuid]
        if not local:
            raise RuntimeError(f"the refit's CUDA IPC ring lives on GPU {uuid}, which this process does not see; "
                               "use rollout.engine_kwargs.vllm.transport=nccl (or auto)")
        args = list(args)
        args[6] = local[0]  # the storage's device, as this process numbers it
        return rebuild(*args)


IPC_SHARING = CudaIpcSharing()


@attrs.frozen
class CudaIpcRendezvous:
    """Where the receivers find the ring and its source (plain data).

    Attributes:
        socket: the socket's name and the ring's geometry (slots, slot bytes, receivers, timeout).
        handle: the ring's handle (RingSharing.export).
    """

    socket: ShmRendezvous
    handle: str

    def to_dict(self) -> dict[str, Any]:
        return {"socket": self.socket.to_dict(), "handle": self.handle}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CudaIpcRendezvous:
        return cls(ShmRendezvous.from_dict(d["socket"]), d["handle"])


def _fence(device: torch.device) -> None:
    """Wait for the work this process queued on `device`'s current stream (the copies in or out of a slot)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


@attrs.define
class CudaIpcTransport(ShmTransport):
    """A BucketTransport through a ring on a GPU (see the module's docstring): the shared-memory
    ring's protocol, with the slot announced only once its bytes are on the GPU, and released only
    once the receiver's copies out of it are done."""

    @property
    def device(self) -> torch.device:
        return self.mapped.device

    def _broadcast(self, kind: int, body: bytes, step: str) -> None:
        if kind == _CHUNK:  # "filled": the copy into the slot must be complete first
            _fence(self.mapped.device)
        super()._broadcast(kind, body, step)

    def _ack(self, seq: int, index: int) -> None:
        _fence(self.mapped.device)  # "consumed": the copies out of the slot must be complete first
        super()._ack(seq, index)

    def _scratch_of(self, nbytes: int) -> torch.Tensor:
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.mapped.device)
        return self._scratch[:nbytes]


def _as_cuda_ipc(t: ShmTransport) -> CudaIpcTransport:
    return CudaIpcTransport(t.ring, t.slots, t.slot_bytes, t.rank, t.sockets, t.peers, t.timeout_s, t.refit_id,
                            t.bucket_bytes, t.max_tensor_bytes)


@attrs.define
class CudaIpcSource:
    """The source's end before its receivers have connected: the ring and the listening socket."""

    rendezvous: CudaIpcRendezvous
    listening: ShmSource

    @classmethod
    def serve(cls, receivers: int, bucket_bytes: int, device: torch.device | str, *, slots: int = DEFAULT_SLOTS,
              timeout_s: float = 60.0, sharing: RingSharing = IPC_SHARING) -> CudaIpcSource:
        """Allocate a ring of `slots` x `bucket_bytes` on `device` and listen for `receivers` receivers.

        Every bucket up to `bucket_bytes` fits one slot: receivers consume it where it lies.
        """
        ring = torch.empty(slots * bucket_bytes, dtype=torch.uint8, device=device)
        rv = ShmRendezvous(fresh_name("rl-refit-ipc-"), slots, bucket_bytes, receivers, timeout_s)
        handle = sharing.export(ring)
        listener = listen(rv)
        return cls(CudaIpcRendezvous(rv, handle), ShmSource(rv, ring, listener))

    def accept(self, timeout_s: float | None = None) -> CudaIpcTransport:
        """Wait for every receiver (the shared-memory ring's accept), then the source's transport."""
        return _as_cuda_ipc(self.listening.accept(timeout_s))

    def close(self) -> None:
        self.listening.close()


def connect(rendezvous: CudaIpcRendezvous, rank: int, bucket_bytes: int,
            sharing: RingSharing = IPC_SHARING) -> CudaIpcTransport:
    """A receiver's end: map the ring (once), connect to the source, say `rank` (1 and up)."""
    rv = rendezvous.socket
    ring = sharing.open(rendezvous.handle)
    sock = dial(rv, rank)
    return CudaIpcTransport(ring, rv.slots, rv.slot_bytes, rank=rank, sockets=(sock,), peers=(0, rank),
                            timeout_s=rv.timeout_s, bucket_bytes=bucket_bytes)

