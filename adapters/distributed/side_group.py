"""A process group of its own between a trainer and an engine's workers, beside every other world.

An engine process already owns `torch.distributed`: vLLM initializes its default world in every
worker, and a trainer has its own. The refit's group therefore cannot be the default world or a
subgroup of it. A SideGroup is built directly on a store of its own (a TCPStore served by rank 0,
the trainer, on a port the OS picks, behind a key prefix) and a backend object constructed on it
(`ProcessGroupGloo` on CPU, `ProcessGroupNCCL` on GPU); its collectives are that object's methods,
never `torch.distributed`'s functions, which only know groups of the default world.

Rank 0 serves the store; the others connect to `(host, port)`. Construction is collective: every
member blocks until all have joined, so the side that asks the others to join (a control message)
must not wait for their reply before it constructs its own end.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any

import attrs
import torch

try:
    import torch.distributed as dist
except ImportError as err:  # pragma: no cover - torch built without distributed support
    raise ModuleNotFoundError("SideGroup needs torch.distributed", name="torch.distributed") from err

from adapters.distributed.launch import listen_socket

PREFIX = "rl-refit-side"
BACKENDS = ("gloo", "nccl")


@attrs.frozen
class Rendezvous:
    """Where the members of a side group meet (plain data: it travels in control messages).

    Attributes:
        host: the address rank 0's store listens on.
        port: its port.
        world_size: members, rank 0 included.
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors).
        timeout_s: bound on joining and on every collective.
        name: the key prefix in the store (one store could serve several groups).
    """

    host: str
    port: int
    world_size: int
    backend: str = "gloo"
    timeout_s: float = 60.0
    name: str = PREFIX

    def __attrs_post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"side group backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.world_size < 2:
            raise ValueError(f"a side group needs at least 2 members, got world_size={self.world_size}")

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Rendezvous:
        return cls(**d)


@attrs.define
class SideGroup:
    """One member's end of a side group.

    Attributes:
        rendezvous: where the group met.
        rank: this member's rank (0 = the store's owner, the trainer).
        pg: the backend object (ProcessGroupGloo / ProcessGroupNCCL).
        store: the store (kept alive: rank 0's serves the others).
    """

    rendezvous: Rendezvous
    rank: int
    pg: Any
    store: Any = attrs.field(repr=False)

    @staticmethod
    def serve(host: str, world_size: int, *, backend: str = "gloo", timeout_s: float = 60.0) -> tuple[Rendezvous, Any]:
        """Rank 0's store, listening on `host` only, on a port the OS picks.

        Returns:
            The Rendezvous to hand to the other members, and the store (pass it to `join`).
        """
        sock = listen_socket(host)
        port = sock.getsockname()[1]
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, is_master=True, wait_for_workers=False, timeout=timeout,
                              master_listen_fd=sock.detach())  # the store owns the socket from here on
        return Rendezvous(host, store.port, world_size, backend, timeout_s), store

    @classmethod
    def join(cls, rendezvous: Rendezvous, rank: int, store: Any = None) -> SideGroup:
        """Construct this member's end; blocks until every member has joined.

        Args:
            rendezvous: where to meet.
            rank: this member's rank, 1..world_size-1 for the workers.
            store: rank 0's store from `serve` (the others connect to the rendezvous).

        Returns:
            The group.
        """
        rv = rendezvous
        if not 0 <= rank < rv.world_size:
            raise ValueError(f"side group rank must be in [0, {rv.world_size}), got {rank}")
        timeout = datetime.timedelta(seconds=rv.timeout_s)
        if store is None:
            store = dist.TCPStore(rv.host, rv.port, rv.world_size, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(rv.name, store)
        if rv.backend == "gloo":
            options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            options._timeout = timeout
            # gloo's pairs listen on the rendezvous address only (not the hostname's address)
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=rv.host)]
            options._threads = 2
            pg: Any = dist.ProcessGroupGloo(prefixed, rank, rv.world_size, options)
        else:  # pragma: no cover - needs CUDA
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, rv.world_size, options)
        return cls(rv, rank, pg, store)

    @property
    def device(self) -> torch.device:
        """Where this group's tensors live."""
        return torch.device("cpu") if self.rendezvous.backend == "gloo" else torch.device("cuda", torch.cuda.current_device())

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.rendezvous.world_size))

    def broadcast_async(self, tensor: torch.Tensor, root: int) -> Any:
        """Broadcast `tensor` from `root` (a rank of this group); returns the Work to wait on."""
        return self.pg.broadcast(tensor, root)

    def close(self) -> None:
        """Leave the group (the store goes when the last reference does)."""
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            with contextlib.suppress(RuntimeError):  # already torn down by a failed peer
                shutdown()
