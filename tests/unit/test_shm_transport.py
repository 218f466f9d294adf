"""The shared-memory transport's own behaviour, beyond the BucketTransport contract
(tests/contract/test_bucket_transport_contract.py): a ring that is never a file, two receivers on
one ring, a receiver in another process, who may join, and each failure's typed error. (What a
SIGKILL leaves: tests/unit/test_shm_ring_kills.py.)

A deadline that a test makes expire on purpose may be short here: the source judges every
connection already queued, with its hello already sent, before it looks at the clock again."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import multiprocessing as mp
import os
import socket
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
import structlog
import structlog.testing
import torch

from adapters.distributed import shm_transport
from adapters.distributed.receiving import receive_buffer
from adapters.distributed.shm_transport import ShmSource, ShmTransport, connect
from domain.errors import (
    CollectiveTimeout,
    PeerLost,
    SharedMemoryUnavailable,
    TransportAborted,
    WireProtocolError,
)
from domain.refit.buckets import Bucket, BucketPlanner, unpack_bucket
from tests.refit_support import shm_pair

BUCKET = 1 << 16


def _tensors(seed: int = 3, count: int = 40) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = [(f"w{i}", torch.randn(500 + 97 * i, generator=g).to(torch.bfloat16)) for i in range(count)]
    out.insert(7, ("embed", torch.randn(3 * BUCKET, generator=g)))  # a lone tensor of 12 buckets' bytes
    return out


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _buckets(tensors: list[tuple[str, torch.Tensor]], by_reference: bool = False) -> Any:
    return BucketPlanner(BUCKET, reuse_buffer=not by_reference, by_reference=by_reference).pack(iter(tensors))


def _receive_digests(end: ShmTransport, keep: bool, box: dict[str, Any]) -> None:
    digests: dict[str, str] = {}
    kept: list[Bucket] = []

    def consume(b: Bucket) -> None:
        if keep:
            kept.append(b)
        else:
            digests.update({n: _digest(v) for n, v in unpack_bucket(b)})

    try:
        stats = end.receive(consume, (lambda n: torch.empty(n, dtype=torch.uint8)) if keep else None)
        digests.update({n: _digest(v) for b in kept for n, v in unpack_bucket(b)})
        box.update(digests=digests, stats=stats)
    except Exception as err:  # handed to the test thread
        box["error"] = err


def _thread(end: ShmTransport, keep: bool = False) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}
    th = threading.Thread(target=_receive_digests, args=(end, keep, box))
    th.start()
    return th, box


def _abstract_names() -> set[str]:
    """The names of the Unix sockets in the abstract namespace ("@name" in /proc/net/unix)."""
    lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    return {f.split()[-1][1:] for f in lines if len(f.split()) == 8 and f.split()[-1].startswith("@")}


def test_the_ring_is_sealed_anonymous_memory_and_its_socket_has_no_file() -> None:
    source = ShmSource.serve(1, slots=2, slot_bytes=4096)
    fd = source.ring_fd
    assert fd is not None
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:rl-refit-ring")  # no path on any file system
    assert os.fstat(fd).st_size == 2 * 4096
    with pytest.raises(PermissionError):  # nobody can shrink it under a mapping (a SIGBUS there)
        os.ftruncate(fd, 4096)
    assert source.rendezvous.name in _abstract_names()
    end = connect(source.rendezvous, 1, BUCKET)
    sender = source.accept()
    assert source.ring_fd is None
    with pytest.raises(PeerLost, match="nobody listens"):  # it stopped listening
        connect(source.rendezvous, 1, BUCKET)
    th, box = _thread(end)  # and the ring works: it lives on in the two mappings
    sender.send(_buckets(_tensors()))
    th.join(30)
    assert box["digests"] == {n: _digest(t) for n, t in _tensors()}
    sender.close()
    end.close()


@pytest.mark.parametrize("keep", [False, True], ids=["in-ring", "own-buffers"])
def test_two_receivers_on_one_ring_each_get_every_bucket(keep: bool) -> None:
    source, ends = shm_pair(2, bucket_bytes=BUCKET, slots=2, slot_bytes=BUCKET // 4, timeout_s=60)
    threads = [_thread(e, keep) for e in ends]
    stats = source.send(_buckets(_tensors(), by_reference=True))
    for th, box in threads:
        th.join(30)
        assert "error" not in box, box
        assert box["digests"] == {n: _digest(t) for n, t in _tensors()}
        assert box["stats"].buckets == stats.buckets and box["stats"].payload_bytes == stats.payload_bytes
    for t in (source, *ends):
        t.close()


def test_streams_follow_one_another_on_one_ring() -> None:
    source, (end,) = shm_pair(1, bucket_bytes=BUCKET, slots=3, slot_bytes=5000, timeout_s=60)
    for refit in (1, 2, 3):
        source.refit_id = end.refit_id = refit
        th, box = _thread(end)
        source.send(_buckets(_tensors(seed=refit)))
        th.join(30)
        assert box["digests"] == {n: _digest(t) for n, t in _tensors(seed=refit)}


def _receiver_process(rendezvous: dict[str, Any], out: Any) -> None:
    from adapters.distributed.shm_transport import ShmRendezvous

    end = connect(ShmRendezvous.from_dict(rendezvous), 1, BUCKET)
    box: dict[str, Any] = {}
    _receive_digests(end, True, box)
    out.put(box.get("digests") or repr(box.get("error")))


def test_a_receiver_in_another_process_gets_the_stream_intact() -> None:
    ctx = mp.get_context("spawn")
    source = ShmSource.serve(1, slots=2, slot_bytes=BUCKET // 2, timeout_s=60)
    out = ctx.Queue()
    proc = ctx.Process(target=_receiver_process, args=(source.rendezvous.to_dict(), out))
    proc.start()
    try:
        sender = source.accept()
        sender.send(_buckets(_tensors()))
        assert out.get(timeout=60) == {n: _digest(t) for n, t in _tensors()}
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


def test_a_receiver_that_is_gone_is_a_lost_peer_for_the_source() -> None:
    source, (end,) = shm_pair(1, bucket_bytes=BUCKET, slots=1, slot_bytes=4096, timeout_s=60)
    end.close()
    with pytest.raises(PeerLost, match=r"rank 1 closed the shared-memory stream"):
        source.send(_buckets(_tensors()))


def test_a_source_that_is_gone_is_a_lost_peer_for_the_receiver_and_later_streams_are_refused() -> None:
    source, (end,) = shm_pair(1, bucket_bytes=BUCKET, slots=1, slot_bytes=4096, timeout_s=60)
    source.close()
    with pytest.raises(PeerLost, match=r"the trainer closed the shared-memory stream"):
        end.receive(lambda b: None)
    with pytest.raises(WireProtocolError, match="out of step"):
        end.receive(lambda b: None)


def test_a_receiver_that_does_not_release_its_slot_times_out_naming_it() -> None:
    source, (end,) = shm_pair(1, bucket_bytes=BUCKET, slots=1, slot_bytes=4096, timeout_s=0.5)
    with pytest.raises(CollectiveTimeout, match=r"rank 1 releasing slot 0"):
        source.send(_buckets(_tensors()))  # nobody receives: the second slot never frees
    end.close()


def test_a_silent_source_times_out_on_the_receiver() -> None:
    source, (end,) = shm_pair(1, bucket_bytes=BUCKET, slots=1, slot_bytes=4096, timeout_s=0.3)
    with pytest.raises(CollectiveTimeout, match=r"bucket 0 header"):
        end.receive(lambda b: None)
    source.close()


def test_receivers_that_never_connect_time_out_and_the_source_stops_listening() -> None:
    source = ShmSource.serve(2, slots=1, slot_bytes=4096, timeout_s=0.3)
    end = connect(source.rendezvous, 1, BUCKET)
    with pytest.raises(CollectiveTimeout, match=r"1 of 2 came"):
        source.accept()
    assert source.ring_fd is None
    with pytest.raises(PeerLost, match=r"nobody listens .* the trainer exited or gave up"):
        connect(source.rendezvous, 2, BUCKET)
    end.close()


def test_a_source_failure_mid_bucket_aborts_the_receiver_with_its_text() -> None:
    source, (end,) = shm_pair(1, bucket_bytes=BUCKET, slots=1, slot_bytes=1024, timeout_s=60)
    th, box = _thread(end)

    def failing() -> Any:
        for b in _buckets(_tensors()):
            yield b
            if b.index == 2:
                raise ValueError("quantizing w9 failed")

    with pytest.raises(ValueError, match="w9"):
        source.send(failing())
    th.join(30)
    assert isinstance(box["error"], TransportAborted) and "quantizing w9 failed" in str(box["error"])
    source.refit_id = end.refit_id = 1  # the next stream goes through intact
    th, box = _thread(end)
    source.send(_buckets(_tensors()))
    th.join(30)
    assert box["digests"] == {n: _digest(t) for n, t in _tensors()}


def test_a_consumer_failure_drains_the_stream_then_raises() -> None:
    source, (end,) = shm_pair(1, bucket_bytes=BUCKET, slots=2, slot_bytes=4096, timeout_s=60)
    seen: list[int] = []

    def consume(b: Bucket) -> None:
        seen.append(b.index)
        if b.index == 1:
            raise RuntimeError("load_weights failed")

    box: dict[str, Any] = {}

    def receive() -> None:
        try:
            end.receive(consume)
        except RuntimeError as err:
            box["error"] = err

    th = threading.Thread(target=receive)
    th.start()
    stats = source.send(_buckets(_tensors()))
    th.join(30)
    assert stats.buckets > 3 and seen == [0, 1]
    assert "load_weights failed" in str(box["error"])


def test_a_message_out_of_the_protocol_is_refused_and_the_stream_stays_refused() -> None:
    source = ShmSource.serve(1, slots=1, slot_bytes=4096, timeout_s=60)
    end = connect(source.rendezvous, 1, BUCKET)
    sender = source.accept()
    sender.sockets[0].sendall(struct.pack("<4sIQ", b"XXXX", 1, 0))
    with pytest.raises(WireProtocolError, match="malformed message"):
        end.receive(lambda b: None)
    with pytest.raises(WireProtocolError, match="out of step"):
        end.receive(lambda b: None)
    sender.close()


def test_an_oversized_announcement_is_refused_before_anything_is_read() -> None:
    source = ShmSource.serve(1, slots=1, slot_bytes=4096, timeout_s=60)
    end = connect(source.rendezvous, 1, BUCKET)
    sender = source.accept()
    sender.sockets[0].sendall(struct.pack("<4sIQ", b"RFSH", 1, 1 << 40))
    with pytest.raises(WireProtocolError, match="above the"):
        end.receive(lambda b: None)
    sender.close()


def test_a_ring_of_another_size_is_refused_by_the_receiver() -> None:
    source = ShmSource.serve(1, slots=2, slot_bytes=4096, timeout_s=60)
    assert source.ring_fd is not None
    os.close(source.ring_fd)
    source.ring_fd = os.memfd_create("another-ring")  # what the source hands over is not what it announced
    os.ftruncate(source.ring_fd, 4096)
    end = connect(source.rendezvous, 1, BUCKET)
    sender = source.accept()
    with pytest.raises(WireProtocolError, match="holds 4096 bytes, not the 8192"):
        end.receive(lambda b: None)
    with pytest.raises(WireProtocolError, match="out of step"):
        end.receive(lambda b: None)
    sender.close()
    end.close()


def test_a_handover_without_the_ring_is_refused_by_the_receiver() -> None:
    source = ShmSource.serve(1, slots=1, slot_bytes=4096, timeout_s=60)
    source.ring_fd, fd = None, source.ring_fd  # the source hands nothing over
    end = connect(source.rendezvous, 1, BUCKET)
    sender = source.accept()
    sender.sockets[0].sendall(struct.pack("<4sIQ", b"RFSH", 3, 0))  # the handover's message, no descriptor
    with pytest.raises(WireProtocolError, match=r"0 descriptors where the shared-memory ring's handover"):
        end.receive(lambda b: None)
    assert fd is not None
    os.close(fd)
    sender.close()
    end.close()


def _stranger(source: ShmSource, hello: bytes) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(source.rendezvous.address)
    s.sendall(hello)
    return s


@pytest.mark.parametrize(("hello", "why"), [
    (b"GET / HTTP/1.1\r\n\r\n" + bytes(10), "malformed hello"),
    (b"RFSH" + (1).to_bytes(8, "little") + bytes(16), "without the ring's token"),
])
def test_a_stranger_on_the_socket_is_refused_and_the_real_receiver_still_joins(hello: bytes, why: str) -> None:
    source = ShmSource.serve(1, slots=1, slot_bytes=4096, timeout_s=30)
    stranger = _stranger(source, hello)  # connects first, as an impostor of the same user could
    end = connect(source.rendezvous, 1, BUCKET)
    with structlog.testing.capture_logs() as logs:
        transport = source.accept()
    assert transport.peers == (0, 1)
    assert any(why in str(e.get("why")) for e in logs), logs
    assert stranger.recv(1) == b""  # its connection was closed
    stranger.close()
    end.close()
    transport.close()


def test_a_rank_beyond_the_receiver_count_is_refused() -> None:
    source = ShmSource.serve(1, slots=1, slot_bytes=4096, timeout_s=30)
    intruder = _stranger(source, source.rendezvous.hello(99))  # knows the token, claims a rank that is not there
    end = connect(source.rendezvous, 1, BUCKET)
    with structlog.testing.capture_logs() as logs:
        transport = source.accept()
    assert transport.peers == (0, 1)
    assert any("rank 99, outside 1..1" in str(e.get("why")) for e in logs), logs
    intruder.close()
    end.close()
    transport.close()


def test_a_connection_of_another_user_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    source = ShmSource.serve(1, slots=1, slot_bytes=4096, timeout_s=0.3)
    end = connect(source.rendezvous, 1, BUCKET)  # it knows the token; the kernel says another user connected
    monkeypatch.setattr(shm_transport, "_peer_uid", lambda sock: os.getuid() + 4242)
    with pytest.raises(CollectiveTimeout, match=rf"refused: a connection of user {os.getuid() + 4242}, not this user"):
        source.accept()
    end.close()


def test_receivers_refused_are_named_when_the_real_ones_never_come() -> None:
    source = ShmSource.serve(1, slots=1, slot_bytes=4096, timeout_s=1.0)
    stranger = _stranger(source, b"RFSH" + (1).to_bytes(8, "little") + bytes(16))
    with pytest.raises(CollectiveTimeout, match="refused: a hello of rank 1 without the ring's token"):
        source.accept()
    stranger.close()


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("call", ["memfd_create", "posix_fallocate"])
def test_a_ring_that_cannot_be_made_says_why_and_what_to_do(call: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, call, refused)
    before = _open_fds()
    with pytest.raises(SharedMemoryUnavailable, match=r"8 MiB shared-memory ring: No space left on device; "
                                                      r"free memory .*transport=gloo"):
        ShmSource.serve(1, slots=2, slot_bytes=4 << 20)
    assert _open_fds() <= before  # nothing half-made is left open


def test_the_ring_is_sealed_against_resizing() -> None:
    source = ShmSource.serve(1, slots=1, slot_bytes=4096)
    assert source.ring_fd is not None
    seals = fcntl.fcntl(source.ring_fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
    source.close()


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_HUGEPAGE") or not Path("/proc/self/smaps").exists(),
                    reason="huge-page advice needs Linux's madvise(MADV_HUGEPAGE) and /proc/self/smaps")
def test_a_receive_buffer_is_its_own_mapping_advised_for_huge_pages() -> None:
    buf = receive_buffer(8 << 20)
    buf.fill_(7)
    assert buf.numel() == 8 << 20 and buf.dtype == torch.uint8 and int(buf[-1]) == 7
    start = buf.data_ptr()
    flags = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= start < hi
        elif line.startswith("VmFlags:") and inside:
            flags = line.split()[1:]
            break
    assert flags is not None and "hg" in flags, flags
    assert receive_buffer(1000).numel() == 1000  # small ones: a plain allocation
