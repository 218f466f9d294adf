"""Peak memory of a piece of torch code, on CPU as on GPU.

On CUDA the caching allocator's own statistics are used (`torch.cuda.max_memory_allocated`).
The CPU allocator keeps no such statistics, so on CPU `TensorBytesTracker` counts them itself:
a `TorchDispatchMode` sees every aten operator that runs inside the block (forward and
backward alike) and records the storage of each output that the operator's schema marks as
freshly allocated (no alias annotation: views and in-place results are not new memory). A weak
reference to each storage tells when it is freed. After every operator, the bytes of the live
recorded storages are summed; the peak is the largest such sum. The lifetimes are kept, so a
peak can also be recomputed without chosen tensors (e.g. the gradients a backward returns).

What it measures: bytes held by tensors created inside the block, at operator boundaries.
What it does not: memory that existed before the block (inputs, parameters), scratch space an
operator allocates and frees inside a single kernel, and allocator overhead (fragmentation,
caching). Those are the same for the paths a benchmark compares, or small next to [T, V] logits.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@attrs.define
class _Lifetime:
    ptr: int
    nbytes: int
    ref: StorageWeakRef
    born: int
    died: int | None = None


class TensorBytesTracker(TorchDispatchMode):
    """Counts bytes of tensors allocated inside the `with` block; `peak_bytes` is the maximum.

    Usage:
        with TensorBytesTracker() as t:
            run()
        t.peak_bytes, t.peak_bytes_without([x.grad])
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, _Lifetime] = {}
        self._all: list[_Lifetime] = []
        self._step = 0
        self.current_bytes = 0
        self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._step += 1
        for t in _fresh_outputs(func, out):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if storage.nbytes() and ptr not in self._live:
                life = _Lifetime(ptr, storage.nbytes(), StorageWeakRef(storage), self._step)
                self._live[ptr] = life
                self._all.append(life)
        self._sweep()
        return out

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._step += 1
        self._sweep()

    def _sweep(self) -> None:
        for ptr in [p for p, life in self._live.items() if life.ref.expired()]:
            self._live.pop(ptr).died = self._step
        self.current_bytes = sum(life.nbytes for life in self._live.values())
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def peak_bytes_without(self, tensors: Iterable[torch.Tensor | None]) -> int:
        """The peak recomputed as if the storages of `tensors` (still alive) had never existed.

        Args:
            tensors: tensors created inside the block and alive now (e.g. parameter gradients).

        Returns:
            The peak in bytes, over the same operator boundaries.
        """
        ptrs = {t.untyped_storage().data_ptr() for t in tensors if t is not None}
        skip = {id(life) for life in self._live.values() if life.ptr in ptrs}
        delta: dict[int, int] = {}
        for life in self._all:
            if id(life) in skip:
                continue
            delta[life.born] = delta.get(life.born, 0) + life.nbytes
            if life.died is not None:
                delta[life.died] = delta.get(life.died, 0) - life.nbytes
        peak = current = 0
        for step in sorted(delta):
            current += delta[step]
            peak = max(peak, current)
        return peak


def _fresh_outputs(func: Any, out: Any) -> list[torch.Tensor]:
    returns = func._schema.returns
    outs = out if isinstance(out, (tuple, list)) else (out,)
    fresh: list[torch.Tensor] = []
    for i, o in enumerate(outs):
        if i < len(returns) and returns[i].alias_info is not None:
            continue  # a view or an in-place result: no new memory
        flat, _ = tree_flatten(o)
        fresh.extend(t for t in flat if isinstance(t, torch.Tensor))
    return fresh


def peak_bytes(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Peak bytes allocated while `fn()` runs, above what was allocated before it started.

    Args:
        fn: the code to measure; its return value is dropped before the call returns.
        device: "cuda" uses the CUDA allocator's statistics, anything else `TensorBytesTracker`.

    Returns:
        The peak, in bytes.
    """
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - base)
    with TensorBytesTracker() as tracker:
        fn()
    return tracker.peak_bytes


def process_kib(field: str, pid: int | str = "self") -> int:
    """A `/proc/PID/status` memory field of a process (default this one) in KiB (`VmRSS`, `VmHWM`;
    Linux), 0 if absent or the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return 0
    return 0


def reset_peak_rss(pid: int | str = "self") -> int:
    """Reset a process's (default this one's) peak resident size (VmHWM) to its current one (Linux;
    elsewhere a no-op); returns the current VmRSS in KiB, the base a later `process_kib("VmHWM")`
    is measured from."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return process_kib("VmRSS", pid)


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (Linux: /proc/PID/task/*/children), parents first."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
            except OSError:
                continue
    return out
