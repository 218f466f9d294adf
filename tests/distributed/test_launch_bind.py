"""A refit world listens only on the address it was given: the rendezvous store and gloo's own
listeners, read from the kernel's socket table of every rank (torch's TCPStore server alone
binds every interface, `*:PORT`, whatever host it is given)."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import sys
from pathlib import Path

import pytest

from adapters.distributed.launch import launch_world

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp, Linux only"),
]


def _listening() -> list[tuple[str, int]]:
    """(address, port) of every TCP socket this process listens on."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))  # /proc prints host-order words
            found.append((str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return found


def _outside_address() -> str | None:
    """This machine's address on its default route (no packet is sent), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def _rank(rank: int, inherited: frozenset[tuple[str, int]]) -> dict:
    import torch.distributed as dist

    dist.barrier()  # every listener exists
    # A forked rank also holds the sockets its parent had open (e.g. an earlier test's store in
    # the test process): they are not the world's.
    mine = [s for s in _listening() if s not in inherited]
    outside = _outside_address()
    reachable = []
    if outside is not None:
        for _, port in mine:
            with socket.socket() as s:
                s.settimeout(2)
                if s.connect_ex((outside, port)) not in (errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EHOSTUNREACH):
                    reachable.append(port)
    dist.barrier()
    return {"listening": mine, "outside": outside, "reachable": reachable}


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2"])
def test_every_listener_binds_the_given_address(host: str) -> None:
    results = launch_world(_rank, 2, (frozenset(_listening()),), timeout_s=60, host=host)
    assert all(r.ok for r in results), [(r.error, r.traceback) for r in results]
    for r in results:
        addresses = {a for a, _ in r.value["listening"]}
        assert r.value["listening"], f"rank {r.rank} listens on nothing?"
        assert addresses == {host}, f"rank {r.rank} listens on {r.value['listening']}, not only {host}"
        assert r.value["reachable"] == [], f"rank {r.rank}: ports {r.value['reachable']} answer on {r.value['outside']}"
    # rank 0 also serves the store: one listener more than gloo's
    assert len(results[0].value["listening"]) > len(results[1].value["listening"])
