"""A trainer SIGKILLed at any step of the shared-memory ring's life leaves nothing on disk
(docs/errors.md, "What is left on disk"): not in /dev/shm, not in the temp directory.

A child process runs the ring's source and says where it is on stdout; the test kills it there
with SIGKILL: right after `ShmSource.serve` (the first refit's join round trip), while `accept`
waits with one of two receivers in, and in the middle of a stream. The child's temp directory is
private (TMPDIR), so any file it made there shows in a listing. /dev/shm is shared with whatever
else runs on the machine, so there the test looks at what the child itself held (its open files
and mappings, read from /proc just before the kill): none of it may exist after the kill."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from adapters.distributed.shm_transport import ShmRendezvous, connect
from domain.errors import PeerLost
from domain.refit.buckets import Bucket

REPO = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")
WAIT_S = 120  # a ceiling for what should be quick (a child's start includes importing torch)

_CHILD = r"""
import json, sys, time
import torch
from adapters.distributed.shm_transport import ShmSource
from domain.refit.buckets import BucketPlanner

point = sys.argv[1]
source = ShmSource.serve(2 if point == "accept" else 1, slots=2, slot_bytes=4096, timeout_s=600)
print(json.dumps({"point": "served", "rendezvous": source.rendezvous.to_dict()}), flush=True)
if point == "served":
    time.sleep(600)
sender = source.accept()  # "accept": one receiver of two comes, so it waits here


def buckets():
    named = [(f"w{i}", torch.full((3000,), float(i))) for i in range(8)]
    for bucket in BucketPlanner(1 << 14).pack(iter(named)):
        if bucket.index == 2:
            print(json.dumps({"point": "mid-stream"}), flush=True)
            time.sleep(600)
        yield bucket


sender.send(buckets())
"""


def _held(pid: int) -> set[str]:
    """The paths of the files process `pid` has open or mapped (those already unlinked left out)."""
    proc = Path(f"/proc/{pid}")
    paths = set()
    for fd in (proc / "fd").iterdir():
        try:
            paths.add(os.readlink(fd))
        except OSError:  # closed meanwhile
            continue
    for line in (proc / "maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6:
            paths.add(fields[5])
    return {p for p in paths if p.startswith("/") and not p.endswith(" (deleted)")}


class _Child:
    """The ring's source in a child process, its stdout read line by line."""

    def __init__(self, point: str, tmp: Path) -> None:
        env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, point], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def said(self, point: str) -> dict[str, Any]:
        try:
            said = json.loads(self.lines.get(timeout=WAIT_S))
        except queue.Empty:
            self.proc.kill()
            pytest.fail(f"the child never reached {point!r}: {self.proc.communicate(timeout=WAIT_S)[1][-3000:]}")
        assert said["point"] == point, said
        return said

    def kill(self) -> set[str]:
        """SIGKILL the child; what it held just before."""
        held = _held(self.proc.pid)
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(WAIT_S)
        assert self.proc.returncode == -signal.SIGKILL
        return held


def _receive(end: Any, got: list[int], box: dict[str, Any]) -> None:
    def consume(bucket: Bucket) -> None:
        got.append(bucket.index)

    try:
        end.receive(consume)
    except Exception as err:
        box["error"] = err


@pytest.mark.parametrize("point", ["served", "accept", "mid-stream"])
def test_a_trainer_killed_at_any_step_of_the_ring_leaves_nothing_on_disk(point: str, tmp_path: Path) -> None:
    tmp = tmp_path / "child-tmp"
    tmp.mkdir()
    shm_before = set(os.listdir(SHM)) if SHM.is_dir() else set()
    child = _Child(point, tmp)
    rv = ShmRendezvous.from_dict(child.said("served")["rendezvous"])
    end, thread, got, box = None, None, [], {}
    if point == "accept":
        end = connect(rv, 1, 1 << 14)
        end.sockets[0].settimeout(WAIT_S)
        data, fds, _, _ = socket.recv_fds(end.sockets[0], 16, 1)  # handed the ring: the child accepted it
        assert len(data) > 0 and len(fds) == 1
        for fd in fds:
            os.close(fd)
    elif point == "mid-stream":
        end = connect(rv, 1, 1 << 14)
        thread = threading.Thread(target=_receive, args=(end, got, box))
        thread.start()
        child.said("mid-stream")
    held = child.kill()
    if thread is not None:
        thread.join(WAIT_S)
        assert got == [0, 1] and isinstance(box.get("error"), PeerLost), (got, box)
    if end is not None:
        end.close()

    assert list(tmp.iterdir()) == []
    ours = {p for p in held if p.startswith((f"{SHM}/", f"{tmp}/"))}
    assert [p for p in ours if os.path.lexists(p)] == []
    shm_new = (set(os.listdir(SHM)) if SHM.is_dir() else set()) - shm_before
    assert [n for n in shm_new if any(p.startswith(f"{SHM / n}/") or p == str(SHM / n) for p in held)] == []
