"""launch_world says why a rank returned nothing: killed at the deadline, or dead on its own.

No verdict here depends on the machine's load: the deadline is long enough for the world to form on
a busy machine (30 s), and the hanging rank hangs for far longer than that (it is killed)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from adapters.distributed.launch import launch_world

pytestmark = pytest.mark.distributed


def _dies(rank: int, how: str) -> int:
    if rank == 1:
        if how == "signal":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "hang":
            time.sleep(3600)  # killed at the deadline long before
    return rank


def test_a_rank_killed_by_a_signal_is_named_so_not_as_a_timeout() -> None:
    t0 = time.monotonic()
    results = launch_world(_dies, 2, ("signal",), timeout_s=600)
    assert results[0].ok and results[0].value == 0
    # the message is not the deadline's, and the world ended far before it (a generous ceiling)
    assert not results[1].ok and results[1].error == "it died from signal 9 (SIGKILL) before reporting a result"
    assert time.monotonic() - t0 < 300


def test_a_rank_still_running_at_the_deadline_is_killed_and_said_so() -> None:
    # before: 3 s, which a busy machine spent forming the world (rank 1 then got DistNetworkError)
    results = launch_world(_dies, 2, ("hang",), timeout_s=30)
    assert results[0].ok, (results[0].error, results[0].output)
    assert results[1].error == "no result within 30 s: still running at the deadline, killed", results[1].output
