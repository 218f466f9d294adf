"""A bucket transport through shared memory, for a source and receivers on one host.

The source writes each bucket's bytes, a slot at a time, into a ring of `slots` slots in memory it
maps and its receivers map too. A Unix-domain socket per receiver carries what is small: the
bucket's header and tensor metadata, a notice per filled slot, and the receiver's acknowledgement
once it has copied the slot out (or consumed it). The source refills a slot only after every
receiver acknowledged it, so packing the next bucket overlaps the receivers' copying and loading,
and a bucket of any size passes through a ring of fixed size.

This replaces a socket's serialization (the bytes through the kernel, twice, on one core) by one
`memcpy` on each side: the source's into the slot and the receiver's out of it.

Nothing of it is ever a file: the ring is anonymous memory (`memfd_create`), its size sealed, and
the source's listening socket has a name in Linux's abstract namespace, which the kernel removes
with the socket. Whenever either side dies, SIGKILL included, the ring goes with the last process
that maps it and nothing is left in /dev/shm or the temp directory.

Setup: `ShmSource.serve` makes the ring (its pages reserved) and the listening socket, and a
`ShmRendezvous` (plain data) to hand to the receivers. Each receiver's `connect` connects and says
its rank and the ring's token; it returns at once (the listening socket queues it). The source's
`accept` takes them all, refusing strangers (another user, no token, a rank beyond the count or
taken), and hands each receiver the ring's descriptor on its socket (SCM_RIGHTS); the receiver maps
it when its first stream begins.

Failures: a peer that closes its socket (crashed or exited) raises PeerLost; a peer silent for
`timeout_s` raises CollectiveTimeout naming the rank and the step; a message that is not the
expected one raises WireProtocolError, after which the receiver refuses every later stream.
"""

from __future__ import annotations

import contextlib
import fcntl
import hmac
import mmap
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import structlog
import torch

from adapters.distributed.receiving import consume_draining
from adapters.distributed.wire import (
    HEADER_WORDS,
    FrameKind,
    Header,
    StreamLimits,
    decode_metas,
    decode_text,
    encode_metas,
    encode_text,
)
from domain.errors import (
    CollectiveTimeout,
    PeerLost,
    SharedMemoryUnavailable,
    TransportAborted,
    WireProtocolError,
)
from domain.refit.buckets import Bucket
from domain.refit.status import TransferStats

log = structlog.get_logger()

DEFAULT_SLOTS = 4
DEFAULT_SLOT_BYTES = 32 << 20
# every message from the source: magic, kind, body length; then the body
_PREFIX = struct.Struct("<4sI Q")
_MAGIC = b"RFSH"
# a wire Header (and its metadata or text) / a filled slot / the ring's descriptor (no body)
_FRAME, _CHUNK, _RING = 1, 2, 3
_CHUNK_BODY = struct.Struct("<QQQ")  # the slot's sequence number, its offset in the bucket, its bytes
_ACK = struct.Struct("<Q")  # receiver -> source: the sequence number of the slot it released
_HELLO = struct.Struct("<4sQ16s")  # receiver -> source, once: magic, rank and the ring's token
_HEADER_BYTES = HEADER_WORDS * 8
_CREDENTIALS = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL  # nobody resizes the ring under a mapping
_SOCKET_NAME_BYTES = 107  # an abstract name fills sun_path (108 bytes) after its leading NUL


def fresh_name(prefix: str = "rl-refit-shm-") -> str:
    """A new name for a listening socket in the abstract namespace (random: two rings never meet)."""
    return f"{prefix}{os.getpid()}-{secrets.token_hex(8)}"


def _check_name(_: Any, __: Any, name: str) -> None:
    if not name or "\0" in name or len(name.encode()) > _SOCKET_NAME_BYTES:
        raise ValueError(f"a shared-memory ring's socket name must be 1..{_SOCKET_NAME_BYTES} bytes without NUL; "
                         f"got {name!r}: use the rendezvous ShmSource.serve made")


@attrs.frozen
class ShmRendezvous:
    """Where the receivers find a ring's source (plain data: it travels in control messages).

    Attributes:
        name: the source's listening socket, in Linux's abstract namespace (no file; the kernel
            adds the leading NUL): reachable from this host's network namespace only.
        slots: slots in the ring.
        slot_bytes: bytes of each slot.
        receivers: how many receivers the source waits for.
        timeout_s: bound on connecting and on every wait.
        token: what a receiver proves itself with (hex, 16 bytes): only those who were handed the
            rendezvous know it. An abstract socket has no permissions, so the source also refuses
            connections of another user (root excepted), as a private directory would have.
    """

    name: str = attrs.field(validator=_check_name)
    slots: int
    slot_bytes: int
    receivers: int
    timeout_s: float = 60.0
    token: str = attrs.field(factory=lambda: secrets.token_hex(16))

    def __attrs_post_init__(self) -> None:
        if self.slots < 1 or self.slot_bytes < 1 or self.receivers < 1:
            raise ValueError(f"a shared-memory ring needs at least one slot, one byte per slot and one receiver; got "
                             f"slots={self.slots}, slot_bytes={self.slot_bytes}, receivers={self.receivers}")

    @property
    def address(self) -> str:
        """The socket's address for bind/connect (a leading NUL: the abstract namespace)."""
        return "\0" + self.name

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def hello(self, rank: int) -> bytes:
        """What a receiver of `rank` says first on the socket."""
        return _HELLO.pack(_MAGIC, rank, bytes.fromhex(self.token))

    def refusal(self, data: bytes, taken: Iterable[int]) -> str | None:
        """Why a receiver's hello is refused (None: it is accepted): not the protocol, not the ring's
        token, a rank outside 1..receivers, or a rank another receiver already holds."""
        magic, rank, token = _HELLO.unpack(data)
        if magic != _MAGIC:
            return "a malformed hello (not this protocol)"
        if not hmac.compare_digest(token, bytes.fromhex(self.token)):
            return f"a hello of rank {rank} without the ring's token"
        if not 1 <= rank <= self.receivers:
            return f"rank {rank}, outside 1..{self.receivers}"
        if rank in set(taken):
            return f"rank {rank} again"
        return None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShmRendezvous:
        return cls(**d)


def _peer_uid(sock: socket.socket) -> int:
    """The user of the process at the other end of a Unix socket (the kernel's word, SO_PEERCRED)."""
    return _CREDENTIALS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))[1]


def _trusted(uid: int) -> bool:
    """This user, or root: who could have entered a private directory of this user's."""
    return uid in (os.getuid(), 0)


def listen(rendezvous: ShmRendezvous) -> socket.socket:
    """The source's listening socket at the rendezvous' abstract name."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(rendezvous.address)
        listener.listen(max(rendezvous.receivers, 1))
    except BaseException:
        listener.close()
        raise
    return listener


def dial(rendezvous: ShmRendezvous, rank: int) -> socket.socket:
    """A receiver's connection to the source, its hello said. PeerLost when nobody listens there
    (the source exited or gave up), WireProtocolError when another user's process does."""
    rv = rendezvous
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(rv.timeout_s)
        try:
            sock.connect(rv.address)
        except (ConnectionRefusedError, FileNotFoundError) as err:
            raise PeerLost(f"rank {rank}: nobody listens at the shared-memory ring's socket {rv.name!r} "
                           f"({type(err).__name__}): the trainer exited or gave up; start the refit again") from err
        uid = _peer_uid(sock)
        if not _trusted(uid):
            raise WireProtocolError(f"rank {rank}: the shared-memory ring's socket {rv.name!r} is held by user {uid}, "
                                    "not by this user: the trainer must run as the engine's user; restart the refit")
        sock.sendall(rv.hello(rank))
    except BaseException:
        sock.close()
        raise
    return sock


def _unavailable(size: int, why: str) -> SharedMemoryUnavailable:
    return SharedMemoryUnavailable(
        f"cannot make the refit's {size / 2**20:.0f} MiB shared-memory ring: {why}; free memory on this host (the "
        "ring is this process's memory, reserved up front) or use the gloo transport "
        "(rollout.engine_kwargs.vllm.transport=gloo)")


def _memfd(size: int) -> int:
    """A sealed anonymous memory file of `size` bytes, its pages reserved: a lack of memory fails
    here, never later as a SIGBUS on a write into a mapping of it."""
    make = getattr(os, "memfd_create", None)
    if make is None:
        raise _unavailable(size, "this system has no memfd_create (Linux 3.17 or later is needed)")
    try:
        fd = make("rl-refit-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as err:
        raise _unavailable(size, str(err.strerror or err)) from err
    try:
        os.posix_fallocate(fd, 0, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except OSError as err:
        os.close(fd)
        raise _unavailable(size, str(err.strerror or err)) from err
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map(fd: int, nbytes: int) -> torch.Tensor:
    """The memory file `fd` as a flat uint8 tensor, mapped shared (writes are seen by every
    mapping; the mapping keeps the memory alive after `fd` is closed)."""
    size = os.fstat(fd).st_size
    if size != nbytes:
        raise WireProtocolError(f"the shared-memory ring holds {size} bytes, not the {nbytes} announced; "
                                "the trainer and the engine's workers disagree: restart the engine")
    area = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(area, dtype=torch.uint8)  # holds `area`: unmapped with the last view


@attrs.define
class ShmSource:
    """The source's end before its receivers have connected: the ring and the listening socket.

    `serve` makes them; `accept` waits for every receiver and returns the source's transport.

    Attributes:
        rendezvous: what the receivers are handed.
        ring: the source's mapping of the ring.
        listener: the listening socket.
        ring_fd: the ring's memory file, handed to each receiver it accepts (None: the receivers
            map the ring another way, as CUDA IPC's do).
    """

    rendezvous: ShmRendezvous
    ring: torch.Tensor
    listener: socket.socket
    ring_fd: int | None = None

    @classmethod
    def serve(cls, receivers: int, *, slots: int = DEFAULT_SLOTS, slot_bytes: int = DEFAULT_SLOT_BYTES,
              timeout_s: float = 60.0) -> ShmSource:
        """Make a ring of `slots` x `slot_bytes` and listen for `receivers` receivers.

        The ring's pages are reserved as it is made: a lack of memory fails here, with
        SharedMemoryUnavailable naming the size and what to do, never later as a SIGBUS on a
        write into the mapping.
        """
        rv = ShmRendezvous(fresh_name(), slots, slot_bytes, receivers, timeout_s)
        fd = _memfd(slots * slot_bytes)
        try:
            ring = _map(fd, slots * slot_bytes)
            listener = listen(rv)
        except BaseException:
            os.close(fd)
            raise
        return cls(rv, ring, listener, fd)

    def accept(self, timeout_s: float | None = None) -> ShmTransport:
        """Wait for every receiver to connect and prove itself (this user or root, the ring's
        token, a rank in 1..receivers, each rank once), hand each the ring, then stop listening.
        A connection that does not prove itself is closed and the wait goes on: an impostor
        cannot take a receiver's place. Raises CollectiveTimeout when the receivers do not all
        come in time (naming what was refused)."""
        rv = self.rendezvous
        wait = rv.timeout_s if timeout_s is None else timeout_s
        peers: dict[int, socket.socket] = {}
        refused: list[str] = []
        deadline = time.monotonic() + wait
        try:
            while len(peers) < rv.receivers:
                self.listener.settimeout(max(deadline - time.monotonic(), 0.001))
                try:
                    conn, _ = self.listener.accept()
                except TimeoutError as err:
                    extra = f"; refused: {', '.join(refused)}" if refused else ""
                    raise CollectiveTimeout(0, f"the shared-memory ring's receivers connecting ({len(peers)} of "
                                               f"{rv.receivers} came{extra})", wait, tuple(sorted(peers))) from err
                rank, why = self._admit(conn, peers, deadline)
                if why is not None:
                    conn.close()
                    refused.append(why)
                    log.warning("the shared-memory ring refused a receiver", why=why)
                    continue
                conn.settimeout(rv.timeout_s)
                peers[rank] = conn
        except BaseException:
            for conn in peers.values():
                conn.close()
            self.close()
            raise
        self.close()
        ordered = tuple(peers[r] for r in sorted(peers))
        return ShmTransport(self.ring, rv.slots, rv.slot_bytes, rank=0, sockets=ordered,
                            peers=(0, *sorted(peers)), timeout_s=rv.timeout_s)

    def _admit(self, conn: socket.socket, taken: dict[int, socket.socket], deadline: float) -> tuple[int, str | None]:
        """One connection's rank, and why it is refused (None: admitted, and handed the ring)."""
        uid = _peer_uid(conn)
        if not _trusted(uid):
            return 0, f"a connection of user {uid}, not this user"
        conn.settimeout(max(min(deadline - time.monotonic(), 10.0), 0.001))
        try:
            data = _recv_exact(conn, _HELLO.size)
        except (TimeoutError, ConnectionError, EOFError, OSError) as err:
            return 0, f"a connection that said nothing ({type(err).__name__})"
        why = self.rendezvous.refusal(data, taken)
        if why is not None:
            return 0, why
        rank = int(_HELLO.unpack(data)[1])
        if self.ring_fd is not None:
            try:
                _send_ring(conn, self.ring_fd)
            except OSError as err:
                return rank, f"rank {rank}, gone before it was handed the ring ({type(err).__name__})"
        return rank, None

    def close(self) -> None:
        """Stop listening and let go of the ring's memory file (idempotent; the ring stays mapped
        here, and in every receiver that took it)."""
        self.listener.close()
        fd, self.ring_fd = self.ring_fd, None
        if fd is not None:
            os.close(fd)


def _send_ring(conn: socket.socket, fd: int) -> None:
    """The ring's handover: a message without a body, and the memory file with it (SCM_RIGHTS)."""
    message = _PREFIX.pack(_MAGIC, _RING, 0)
    sent = socket.send_fds(conn, [message], [fd])
    if sent < len(message):
        conn.sendall(message[sent:])


def connect(rendezvous: ShmRendezvous, rank: int, bucket_bytes: int) -> ShmTransport:
    """A receiver's end: connect to the source, say `rank` (1 and up) and the ring's token.

    Returns at once: the source need not have accepted yet (its listening socket queues us). The
    ring arrives on the socket once the source accepts; the first `receive` maps it.
    """
    rv = rendezvous
    sock = dial(rv, rank)
    return ShmTransport(None, rv.slots, rv.slot_bytes, rank=rank, sockets=(sock,), peers=(0, rank),
                        timeout_s=rv.timeout_s, bucket_bytes=bucket_bytes)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """n bytes from `sock`; EOFError when the peer closed first (TimeoutError / OSError pass)."""
    if n == 0:
        return b""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError(f"the peer closed the connection after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _frame_bytes(header: Header, body: bytes = b"") -> bytes:
    """A frame's body on the socket: the wire header's words, then its metadata or text."""
    return header.to_tensor().numpy().tobytes() + body


def _u8(data: bytes) -> torch.Tensor:
    """Bytes as a uint8 tensor of their own."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _fill(bucket: Bucket, offset: int, dest: torch.Tensor) -> None:
    """Bytes [offset, offset + len(dest)) of a bucket (packed, or by reference) into `dest`.
    Padding between tensors of a bucket by reference is left as it is (no receiver reads it)."""
    end = offset + dest.numel()
    if not bucket.by_reference:
        dest.copy_(bucket.buffer[offset:end])
        return
    for meta, t in zip(bucket.metas, bucket.tensors, strict=True):
        lo, hi = max(meta.offset, offset), min(meta.offset + meta.nbytes, end)
        if lo >= hi:
            continue
        flat = t.detach().reshape(-1)
        data = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
        dest[lo - offset : hi - offset].copy_(data[lo - meta.offset : hi - meta.offset])


@attrs.define
class ShmTransport:
    """A BucketTransport through a shared-memory ring (see the module's docstring).

    The source's end (rank 0) has a socket per receiver; a receiver's end has one, to the source.

    Attributes:
        ring: the mapped ring, `slots * slot_bytes` bytes (None: a receiver's before its first
            stream, which maps the ring the source handed over).
        slots: slots in the ring.
        slot_bytes: bytes of each slot.
        rank: 0 for the source, 1.. for the receivers.
        sockets: the connections (source: one per receiver, in rank order; receiver: one).
        peers: every rank of the stream (for errors).
        timeout_s: bound on each wait.
        refit_id: the refit the stream belongs to (checked in every header).
        bucket_bytes: the agreed bucket capacity (a receiver's limits).
        max_tensor_bytes: the largest lone tensor a receiver accepts.
    """

    ring: torch.Tensor | None
    slots: int
    slot_bytes: int
    rank: int
    sockets: tuple[socket.socket, ...]
    peers: tuple[int, ...]
    timeout_s: float = 60.0
    refit_id: int = 0
    bucket_bytes: int = 64 << 20
    max_tensor_bytes: int = 64 << 30
    _seq: int = attrs.field(init=False, default=0)  # slots filled (source) / taken (receiver), ever
    _acked: list[int] = attrs.field(init=False, factory=list)  # source: per receiver, slots released
    _scratch: torch.Tensor | None = attrs.field(init=False, default=None)
    _broken: str | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self._acked = [0] * len(self.sockets)

    @property
    def window(self) -> int:
        """1: the source has copied a bucket's bytes into the ring before it asks for the next
        bucket, so one sender buffer suffices; the ring's slots give the overlap."""
        return 1

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def forget_layout(self) -> None:
        """Nothing to forget: every bucket travels with its metadata."""

    def close(self) -> None:
        """Close the connections (the ring is unmapped when the last view of it goes)."""
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.close()

    # --- source ------------------------------------------------------------------------------

    def send(self, buckets: Iterable[Bucket]) -> TransferStats:
        """Write every bucket through the ring, then END; see ports.bucket_transport.BucketTransport.send."""
        t0 = time.perf_counter()
        n = payload = wire = 0
        blocked = 0.0
        try:
            for bucket in buckets:  # the planner, or the ring, may fail: either way the receivers hear it
                blocked += self._send_bucket(bucket)
                n, payload, wire = n + 1, payload + bucket.payload_bytes, wire + bucket.nbytes
        except Exception as err:
            self._abort(f"{type(err).__name__}: {err}", n)
            raise
        blocked += self._wait_acks(self._seq, "the end of the stream")
        self._broadcast(_FRAME, _frame_bytes(Header(FrameKind.END, self.refit_id, n)), "end of stream")
        return TransferStats(n, payload, wire, time.perf_counter() - t0, blocked)

    def _send_bucket(self, bucket: Bucket) -> float:
        """The bucket's header and metadata, then its bytes a slot at a time; returns the seconds
        spent waiting for free slots."""
        step = f"bucket {bucket.index}"
        metas = encode_metas(bucket.metas)
        header = Header(FrameKind.BUCKET, self.refit_id, bucket.index, bucket.is_last, bucket.nbytes, metas.numel())
        self._broadcast(_FRAME, _frame_bytes(header, metas.numpy().tobytes()), step)
        blocked = 0.0
        for offset in range(0, bucket.nbytes, self.slot_bytes):
            size = min(self.slot_bytes, bucket.nbytes - offset)
            blocked += self._wait_acks(self._seq - self.slots + 1, f"{step} (a free slot)")
            _fill(bucket, offset, self._slot(self._seq)[:size])
            self._broadcast(_CHUNK, _CHUNK_BODY.pack(self._seq, offset, size), step)
            self._seq += 1
        return blocked

    @property
    def mapped(self) -> torch.Tensor:
        """The ring, once mapped (WireProtocolError before: a receiver's first stream maps it)."""
        if self.ring is None:
            raise WireProtocolError(f"rank {self.rank} has not been handed the shared-memory ring yet; "
                                    "its first stream maps it: restart the engine")
        return self.ring

    def _slot(self, seq: int) -> torch.Tensor:
        k = seq % self.slots
        return self.mapped[k * self.slot_bytes : (k + 1) * self.slot_bytes]

    def _abort(self, text: str, sent: int) -> None:
        """Tell the receivers the stream failed after `sent` buckets (best effort: a receiver that
        is gone already is not waited for)."""
        body = encode_text(text[:4000]).numpy().tobytes()
        header = Header(FrameKind.ABORT, self.refit_id, sent, meta_len=len(body))
        with contextlib.suppress(PeerLost, CollectiveTimeout):
            self._broadcast(_FRAME, _frame_bytes(header, body), f"abort after bucket {sent}")

    def _broadcast(self, kind: int, body: bytes, step: str) -> None:
        message = _PREFIX.pack(_MAGIC, kind, len(body)) + body
        for r, s in zip(self.peers[1:], self.sockets, strict=True):
            try:
                s.sendall(message)
            except TimeoutError as err:
                raise CollectiveTimeout(self.rank, f"{step}: sending to rank {r}", self.timeout_s, self.peers) from err
            except OSError as err:
                raise self._lost(r, step, err) from err

    def _wait_acks(self, upto: int, step: str) -> float:
        """Wait until every receiver has released the slots before sequence number `upto`."""
        t0 = time.perf_counter()
        for i, (r, s) in enumerate(zip(self.peers[1:], self.sockets, strict=True)):
            while self._acked[i] < upto:
                try:
                    (seq,) = _ACK.unpack(_recv_exact(s, _ACK.size))
                except TimeoutError as err:
                    raise CollectiveTimeout(self.rank, f"{step}: rank {r} releasing slot {self._acked[i]}",
                                            self.timeout_s, self.peers) from err
                except (EOFError, OSError) as err:
                    raise self._lost(r, step, err) from err
                if seq != self._acked[i]:
                    raise WireProtocolError(f"rank {r} released slot {seq} of the shared-memory ring while slot "
                                            f"{self._acked[i]} was due; restart the engine")
                self._acked[i] = seq + 1
        return time.perf_counter() - t0

    def _lost(self, rank: int, step: str, err: BaseException) -> PeerLost:
        who = "the trainer" if rank == 0 else f"rank {rank}"
        return PeerLost(f"rank {self.rank}: {step} of refit {self.refit_id}: {who} closed the shared-memory "
                        f"stream ({type(err).__name__}: {err}); it crashed or exited. Restart the engine")

    # --- receivers ---------------------------------------------------------------------------

    @property
    def limits(self) -> StreamLimits:
        return StreamLimits(self.bucket_bytes, self.max_tensor_bytes)

    def receive(self, consume: Callable[[Bucket], None], allocate: Callable[[int], torch.Tensor] | None = None) -> TransferStats:
        """Consume buckets until END; see ports.bucket_transport.BucketTransport.receive.

        Without `allocate`, a bucket that fits one slot is consumed where it lies in the ring
        (zero copy; the slot is released when `consume` returns); a larger one is assembled in a
        buffer of the transport's. With `allocate`, every bucket is copied out into the
        consumer's own buffer, slot by slot, each slot released as soon as it is copied.
        """
        if self._broken is not None:
            raise WireProtocolError(f"the shared-memory stream from rank 0 is out of step since {self._broken}; "
                                    "restart the engine")
        rx = _Rx(time.perf_counter())
        try:
            self._receive(rx, consume, allocate)
        except (WireProtocolError, PeerLost, CollectiveTimeout) as err:  # out of step with the source from here
            self._broken = f"refit {self.refit_id} ({type(err).__name__}: {err})"
            raise
        if rx.errors:
            raise rx.errors[0]
        return TransferStats(rx.n, rx.payload, rx.wire, time.perf_counter() - rx.t0, rx.blocked, rx.consumed)

    def _receive(self, rx: _Rx, consume: Callable[[Bucket], None], allocate: Callable[[int], torch.Tensor] | None) -> None:
        if self.ring is None:
            self._take_ring(rx)
        expected: int | None = None
        after_last = False
        while True:
            header, body = self._frame(rx, f"bucket {rx.n} header")
            if header.kind is FrameKind.END:
                self.limits.check_end(header, 0, rx.n)
                return
            if header.kind is FrameKind.ABORT:
                raise self._aborted(header, body, f"after {header.index} buckets")
            self.limits.check_header(header, 0, expected, after_last)
            metas = decode_metas(_u8(body)) if body else ()
            self.limits.check_metas(header, metas, 0)
            expected, after_last = header.index + 1, header.is_last
            nbytes = header.nbytes
            if allocate is None and 0 < nbytes <= self.slot_bytes:  # consumed in the ring, released after
                seq = self._chunk(rx, header, 0, nbytes)
                self._consume(rx, consume, Bucket(header.index, self._slot(seq)[:nbytes], metas, header.is_last))
                self._ack(seq, header.index)
            else:
                dest = allocate(nbytes)[:nbytes] if allocate is not None else self._scratch_of(nbytes)
                for offset in range(0, nbytes, self.slot_bytes):
                    size = min(self.slot_bytes, nbytes - offset)
                    seq = self._chunk(rx, header, offset, size)
                    dest[offset : offset + size].copy_(self._slot(seq)[:size])
                    self._ack(seq, header.index)
                self._consume(rx, consume, Bucket(header.index, dest, metas, header.is_last))
            rx.n, rx.payload, rx.wire = rx.n + 1, rx.payload + sum(m.nbytes for m in metas), rx.wire + nbytes

    def _scratch_of(self, nbytes: int) -> torch.Tensor:
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes]

    def _message(self, rx: _Rx, step: str) -> tuple[int, bytes]:
        """One message from the source: (kind, body)."""
        s = self.sockets[0]
        t0 = time.perf_counter()
        try:
            magic, kind, length = _PREFIX.unpack(_recv_exact(s, _PREFIX.size))
            if magic != _MAGIC or kind not in (_FRAME, _CHUNK):
                raise WireProtocolError(f"rank 0 sent a malformed message at {step} of refit {self.refit_id}")
            limit = _HEADER_BYTES + self.limits.max_meta_bytes
            if length > limit:
                raise WireProtocolError(f"rank 0 announced a {length}-byte message at {step} of refit "
                                        f"{self.refit_id}, above the {limit}-byte limit")
            body = _recv_exact(s, length)
        except TimeoutError as err:
            raise CollectiveTimeout(self.rank, step, self.timeout_s, self.peers) from err
        except (EOFError, OSError) as err:
            raise self._lost(0, step, err) from err
        finally:
            rx.blocked += time.perf_counter() - t0
        return kind, body

    def _take_ring(self, rx: _Rx) -> None:
        """Map the ring the source handed over when it accepted this receiver: the first message
        on the socket, with the ring's memory file attached (SCM_RIGHTS)."""
        step = "the shared-memory ring's handover"
        s = self.sockets[0]
        t0 = time.perf_counter()
        fds: list[int] = []
        try:
            data, fds, flags, _ = socket.recv_fds(s, _PREFIX.size, 1)
            if not data:
                raise EOFError("the peer closed the connection before the ring was handed over")
            data += _recv_exact(s, _PREFIX.size - len(data))
        except TimeoutError as err:
            raise CollectiveTimeout(self.rank, step, self.timeout_s, self.peers) from err
        except (EOFError, OSError) as err:
            for fd in fds:
                os.close(fd)
            raise self._lost(0, step, err) from err
        finally:
            rx.blocked += time.perf_counter() - t0
        try:
            magic, kind, length = _PREFIX.unpack(data)
            if magic != _MAGIC or kind != _RING or length != 0 or len(fds) != 1 or flags & socket.MSG_CTRUNC:
                raise WireProtocolError(f"rank 0 sent a message of kind {kind} with {len(fds)} descriptors where "
                                        f"{step} (one memory file) was due in refit {self.refit_id}; restart the engine")
            self.ring = _map(fds[0], self.slots * self.slot_bytes)
        finally:
            for fd in fds:
                os.close(fd)

    def _frame(self, rx: _Rx, step: str) -> tuple[Header, bytes]:
        kind, body = self._message(rx, step)
        if kind != _FRAME:
            raise WireProtocolError(f"rank 0 sent a slot where {step} of refit {self.refit_id} was due")
        return self._header(body, step)

    def _header(self, body: bytes, step: str) -> tuple[Header, bytes]:
        """A frame's checked header, and the metadata or text after it."""
        if len(body) < _HEADER_BYTES:
            raise WireProtocolError(f"rank 0 sent a {len(body)}-byte frame at {step} of refit {self.refit_id}")
        header = Header.from_tensor(_u8(body[:_HEADER_BYTES]).view(torch.int64), self.refit_id, 0)
        if header.meta_len != len(body) - _HEADER_BYTES:
            raise WireProtocolError(f"rank 0 announced {header.meta_len} bytes after the header of {step} and sent "
                                    f"{len(body) - _HEADER_BYTES}")
        return header, body[_HEADER_BYTES:]

    def _aborted(self, header: Header, text: bytes, where: str) -> TransportAborted:
        self.limits.check_abort(header, 0)
        return TransportAborted(f"rank 0 aborted the bucket stream of refit {self.refit_id} {where}: "
                                f"{decode_text(_u8(text))}")

    def _chunk(self, rx: _Rx, header: Header, offset: int, size: int) -> int:
        """The notice of the next filled slot, which must hold bytes [offset, offset + size) of
        the bucket in hand; returns the slot's sequence number."""
        step = f"bucket {header.index} (bytes {offset}..{offset + size})"
        kind, body = self._message(rx, step)
        if kind == _FRAME:  # only an abort may come mid-bucket
            h, text = self._header(body, step)
            if h.kind is FrameKind.ABORT:
                raise self._aborted(h, text, f"in bucket {header.index}")
            raise WireProtocolError(f"rank 0 sent a header where {step} of refit {self.refit_id} was due")
        if len(body) != _CHUNK_BODY.size:
            raise WireProtocolError(f"rank 0 sent a malformed slot notice at {step} of refit {self.refit_id}")
        seq, got_offset, got_size = _CHUNK_BODY.unpack(body)
        if (seq, got_offset, got_size) != (self._seq, offset, size):
            raise WireProtocolError(f"rank 0 sent slot {seq} with bytes {got_offset}..{got_offset + got_size} where "
                                    f"slot {self._seq} with {step} was due; restart the engine")
        self._seq += 1
        return seq

    def _ack(self, seq: int, index: int) -> None:
        try:
            self.sockets[0].sendall(_ACK.pack(seq))
        except TimeoutError as err:
            raise CollectiveTimeout(self.rank, f"bucket {index}: releasing slot {seq}", self.timeout_s, self.peers) from err
        except OSError as err:
            raise self._lost(0, f"bucket {index}", err) from err

    @staticmethod
    def _consume(rx: _Rx, consume: Callable[[Bucket], None], bucket: Bucket) -> None:
        rx.consumed += consume_draining(consume, bucket, rx.errors)


@attrs.define
class _Rx:
    """One receive call's counts."""

    t0: float
    n: int = 0
    payload: int = 0
    wire: int = 0
    blocked: float = 0.0
    consumed: float = 0.0
    errors: list[BaseException] = attrs.field(factory=list)


__all__: Sequence[str] = ("ShmRendezvous", "ShmSource", "ShmTransport", "connect", "dial", "fresh_name", "listen")
