"""Start a refit world of local processes over gloo on 127.0.0.1, bounded in time.

Rank 0 serves a TCPStore on a free loopback port (the OS picks it, so two worlds never race for
one) and publishes it to the others; every child joins the default process group through it, runs
`fn(rank, *args)` and sends back a small picklable result (or its error, as text). Children that are still running at the
deadline are killed: a hung world ends, it never hangs its caller.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

try:
    import torch.distributed as dist
    import torch.multiprocessing as mp
except ImportError as err:  # pragma: no cover
    raise ModuleNotFoundError("launch_world needs torch.distributed", name="torch.distributed") from err

LOOPBACK = "127.0.0.1"


@attrs.frozen
class RankResult:
    """What one process of a world returned.

    Attributes:
        rank: the process's rank.
        ok: True when `fn` returned.
        value: its return value (ok), else None.
            error: `Type: message` of what it raised, or why it did not report (killed at the deadline).
        traceback: the formatted traceback, when it raised.
        output: the end of what it wrote to stdout / stderr (when `capture_output`).
    """

    rank: int
    ok: bool
    value: Any = None
    error: str | None = None
    traceback: str | None = None
    output: str = ""


def _join(rank: int, size: int, port: Any, pg_timeout_s: float) -> None:
    """Rank 0 serves the rendezvous store on a port the OS picks and publishes it; the others read
    it. (The parent runs no store: a server thread in the parent could hold a lock across fork.)"""
    timeout = datetime.timedelta(seconds=pg_timeout_s)
    if rank == 0:
        store = dist.TCPStore(LOOPBACK, 0, size, is_master=True, wait_for_workers=False, timeout=timeout)
        port.value = store.port
    else:
        deadline = time.monotonic() + pg_timeout_s
        while port.value == 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: rank 0 did not publish the rendezvous port in {pg_timeout_s:g} s")
            time.sleep(0.005)
        store = dist.TCPStore(LOOPBACK, port.value, size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)


def _child(fn: Callable[..., Any], rank: int, size: int, port: Any, results: Any, args: tuple[Any, ...],
           threads: int, pg_timeout_s: float, dump_after_s: float, log_dir: str | None) -> None:
    if log_dir is not None:  # the rank's stdout and stderr (logs, tracebacks) go to its own file
        fd = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    try:
        # One intra-op thread: safe after fork (OpenMP pools do not survive it) and fair on few cores.
        torch.set_num_threads(threads)
        # A hung world shows where it hangs (on fd 2: sys.stderr may be a capture without one).
        faulthandler.dump_traceback_later(dump_after_s, exit=False, file=sys.__stderr__ or 2)
        _join(rank, size, port, pg_timeout_s)
        value = fn(rank, *args)
        results.put(RankResult(rank, True, value))
    except BaseException as err:  # report everything: the parent decides
        results.put(RankResult(rank, False, None, f"{type(err).__name__}: {err}", traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
        results.close()
        results.join_thread()
        os._exit(0)  # never block on a broken process group's destructor


def launch_world(
    fn: Callable[..., Any],
    size: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 120.0,
    start_method: str = "fork",
    threads: int = 1,
    pg_timeout_s: float = 600.0,
    capture_output: bool = True,
) -> list[RankResult]:
    """Run `fn(rank, *args)` in `size` processes joined in one gloo process group on 127.0.0.1.

    Args:
        fn: a module-level function (picklable for `spawn`); its return value must be picklable
            plain data (tensors as bytes).
        size: processes (world size).
        args: extra arguments, the same for every rank.
        timeout_s: wall-clock bound on the whole world; stragglers are killed.
        start_method: `fork` (fast; the children set one thread) or `spawn` / `forkserver`.
        threads: torch intra-op threads per process.
        pg_timeout_s: the process group's own timeout (collective waits are bounded tighter).
        capture_output: send each rank's stdout / stderr to a file and return its end in
            `RankResult.output` (False: they share the caller's terminal).

    Returns:
        One RankResult per rank, by rank.
    """
    ctx = mp.get_context(start_method)
    with tempfile.TemporaryDirectory(prefix="refit-world-") as log_dir:
        results = _run(ctx, fn, size, tuple(args), timeout_s, threads, pg_timeout_s, log_dir if capture_output else None)
        if capture_output:
            results = [attrs.evolve(r, output=_tail(os.path.join(log_dir, f"rank{r.rank}.log"))) for r in results]
    return results


def _tail(path: str, n: int = 6000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _run(ctx: Any, fn: Callable[..., Any], size: int, args: tuple[Any, ...], timeout_s: float, threads: int,
         pg_timeout_s: float, log_dir: str | None) -> list[RankResult]:
    results = ctx.Queue()
    port = ctx.Value("i", 0)
    dump_after = max(timeout_s - 2.0, 1.0)
    procs = [
        ctx.Process(target=_child, daemon=True,
                    args=(fn, r, size, port, results, args, threads, pg_timeout_s, dump_after, log_dir))
        for r in range(size)
    ]
    # Forked children inherit every object of this process, some owned by threads or extensions
    # that do not survive a fork (compiled kernels, thread pools); a garbage collection of them in
    # a child can crash it. Frozen objects are never collected: the children leave them alone.
    gc.collect()
    gc.freeze()
    try:
        for p in procs:
            p.start()
    finally:
        gc.unfreeze()
    got: dict[int, RankResult] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < size and time.monotonic() < deadline:
        try:
            r = results.get(timeout=min(0.2, max(deadline - time.monotonic(), 0.01)))
            got[r.rank] = r
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
    for p in procs:
        p.join(timeout=max(0.0, min(2.0, deadline - time.monotonic())))
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    late = f"no result within {timeout_s:g} s (killed, or it exited without reporting)"
    return [got.get(r, RankResult(r, False, None, late)) for r in range(size)]
