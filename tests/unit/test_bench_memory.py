"""The CPU peak-memory tracker of the benchmarks, on allocations whose sizes are known."""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from app.bench.memory import TensorBytesTracker, peak_bytes, process_kib, reset_peak_rss

MB = 1_000_000


def test_counts_fresh_storages_once_and_ignores_views_and_in_place():
    with TensorBytesTracker() as t:
        a = torch.empty(MB // 4)  # 1 MB
        b = torch.empty(2 * MB // 4)  # 2 MB
        del a
        c = b.view(-1)  # a view: no new memory
        b.add_(1)  # in place: no new memory
        d = torch.empty(MB // 4)  # 1 MB, after `a` was freed
    assert t.peak_bytes == 3 * MB
    assert t.current_bytes == 3 * MB
    del b, c, d


def test_backward_operators_are_seen_and_gradients_can_be_left_out():
    x = torch.randn(MB // 4, requires_grad=True)  # created before: not counted
    with TensorBytesTracker() as t:
        y = (x * 2).exp()  # x*2 freed after exp (exp saves its result): 1 MB held
        y.sum().backward()  # grad of exp (1 MB), then x.grad (1 MB)
    # Plus a few bytes of scalars (the sum and its gradient).
    assert 3 * MB <= t.peak_bytes < 3 * MB + 64
    assert 2 * MB <= t.peak_bytes_without([x.grad]) < 2 * MB + 64


def test_peak_bytes_helper_on_cpu():
    assert peak_bytes(lambda: torch.ones(MB // 4) + 1) == 2 * MB


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc/self/status (Linux)")
def test_the_peak_resident_size_is_reset_and_then_grows_with_an_allocation() -> None:
    base = reset_peak_rss()
    assert base > 0 and process_kib("NoSuchField") == 0
    # Fresh pages from the OS (an anonymous mapping), touched: the allocator's pool of freed but
    # still resident memory (which earlier tests in this process may have left) cannot serve them.
    block = mmap.mmap(-1, 64 * 2**20)
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    assert process_kib("VmHWM") - base >= 60 * 1024
    block.close()
