"""launch_world says why a rank returned nothing: killed at the deadline, or dead on its own."""

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
            time.sleep(60)
    return rank


def test_a_rank_killed_by_a_signal_is_named_so_not_as_a_timeout() -> None:
    t0 = time.monotonic()
    results = launch_world(_dies, 2, ("signal",), timeout_s=60)
    assert results[0].ok and results[0].value == 0
    assert not results[1].ok and results[1].error == "it died from signal 9 (SIGKILL) before reporting a result"
    assert time.monotonic() - t0 < 30  # it did not wait for the deadline


def test_a_rank_still_running_at_the_deadline_is_killed_and_said_so() -> None:
    results = launch_world(_dies, 2, ("hang",), timeout_s=3)
    assert results[0].ok
    assert results[1].error == "no result within 3 s: still running at the deadline, killed"
