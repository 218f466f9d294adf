"""Start a refit world of local processes over gloo on 127.0.0.1, bounded in time.

Rank 0 serves a TCPStore on a free port of the world's address (the OS picks it, so two worlds
never race for one) and publishes it to the others; every child joins the default process group
through it, runs `fn(rank, *args)` and sends back a small picklable result (or its error, as text).
Children that are still running at the deadline are killed: a hung world ends, it never hangs
its caller.

Nothing listens beyond the address given (127.0.0.1 by default). torch's TCPStore server binds
the wildcard address (every interface) whatever host it is given, so rank 0 binds and listens on
a socket itself and hands it over (`master_listen_fd`); and gloo's own listeners bind the address
of the machine's hostname unless a device is named, so the world's process groups use a gloo
backend registered here with a device bound to the same address. The store has no
authentication: anyone who can reach its address can write keys (docs/distributed.md says how to
isolate a world that spans machines).
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import queue
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from domain.errors import RefitError

try:
    import torch.distributed as dist
    import torch.multiprocessing as mp
except ImportError as err:  # pragma: no cover
    raise ModuleNotFoundError("launch_world needs torch.distributed", name="torch.distributed") from err

LOOPBACK = "127.0.0.1"
BACKEND = "gloo_bound"  # gloo, with its listening device bound to the world's address


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
        error_type: the name of the exception's class, when it raised.
        typed: what it raised is one of rl-refit's typed errors (a RefitError, which explains itself).
    """

    rank: int
    ok: bool
    value: Any = None
    error: str | None = None
    traceback: str | None = None
    output: str = ""
    error_type: str | None = None
    typed: bool = False


def listen_socket(host: str) -> socket.socket:
    """A TCP socket bound to `host` on a port the OS picks, listening.

    Args:
        host: an IPv4 or IPv6 address (or a name that resolves to one).

    Returns:
        The socket. Raises OSError when the address is not one of this machine's.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def register_bound_gloo(host: str) -> str:
    """Register (in this process) a gloo backend whose device listens on `host` only.

    Args:
        host: the address gloo's pairs listen on and advertise to their peers.

    Returns:
        The backend name for init_process_group / new_group.
    """
    def create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._threads = 2  # what torch gives one device
        return dist.ProcessGroupGloo(store, rank, size, options)

    dist.Backend.register_backend(BACKEND, create, devices=["cpu"])
    return BACKEND


def _join(rank: int, size: int, port: Any, pg_timeout_s: float, host: str) -> None:
    """Rank 0 serves the rendezvous store on `host`, on a port the OS picks, and publishes the
    port; the others read it. (The parent runs no store: a server thread in the parent could
    hold a lock across fork.)"""
    timeout = datetime.timedelta(seconds=pg_timeout_s)
    if rank == 0:
        sock = listen_socket(host)
        chosen = sock.getsockname()[1]
        store = dist.TCPStore(host, chosen, size, is_master=True, wait_for_workers=False, timeout=timeout,
                              master_listen_fd=sock.detach())  # the store owns the socket from here on
        port.value = store.port
    else:
        deadline = time.monotonic() + pg_timeout_s
        while port.value == 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: rank 0 did not publish the rendezvous port in {pg_timeout_s:g} s")
            time.sleep(0.005)
        store = dist.TCPStore(host, port.value, size, is_master=False, timeout=timeout)
    backend = register_bound_gloo(host)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    # Every rank has joined before any runs: rank 0 serves the store, and a rank 0 that finished
    # and exited while another still read the store mid-join reset that rank's connection.
    dist.barrier()


def _child(fn: Callable[..., Any], rank: int, size: int, port: Any, results: Any, args: tuple[Any, ...],
           threads: int, pg_timeout_s: float, dump_after_s: float, log_dir: str | None, host: str) -> None:
    if log_dir is not None:  # the rank's stdout and stderr (logs, tracebacks) go to its own file
        fd = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    try:
        # One intra-op thread: safe after fork (OpenMP pools do not survive it) and fair on few cores.
        torch.set_num_threads(threads)
        # A hung world shows where it hangs (on fd 2: sys.stderr may be a capture without one).
        faulthandler.dump_traceback_later(dump_after_s, exit=False, file=sys.__stderr__ or 2)
        _join(rank, size, port, pg_timeout_s, host)
        value = fn(rank, *args)
        results.put(RankResult(rank, True, value))
    except BaseException as err:  # report everything: the parent decides
        results.put(RankResult(rank, False, None, f"{type(err).__name__}: {err}", traceback.format_exc(),
                               error_type=type(err).__name__, typed=isinstance(err, RefitError)))
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
    host: str = LOOPBACK,
) -> list[RankResult]:
    """Run `fn(rank, *args)` in `size` processes joined in one gloo process group on `host`.

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
        host: the address the rendezvous store and gloo listen on (127.0.0.1: nothing is
            reachable from other machines).

    Returns:
        One RankResult per rank, by rank.
    """
    ctx = mp.get_context(start_method)
    with tempfile.TemporaryDirectory(prefix="refit-world-") as log_dir:
        results = _run(ctx, fn, size, tuple(args), timeout_s, threads, pg_timeout_s,
                       log_dir if capture_output else None, host)
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
         pg_timeout_s: float, log_dir: str | None, host: str) -> list[RankResult]:
    results = ctx.Queue()
    port = ctx.Value("i", 0)
    dump_after = max(timeout_s - 2.0, 1.0)
    procs = [
        ctx.Process(target=_child, daemon=True,
                    args=(fn, r, size, port, results, args, threads, pg_timeout_s, dump_after, log_dir, host))
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
    killed_at_deadline = set()
    for p in procs:
        p.join(timeout=max(0.0, min(2.0, deadline - time.monotonic())))
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
            killed_at_deadline.add(p)
    return [got.get(r, RankResult(r, False, None, _silence(procs[r], p in killed_at_deadline, timeout_s)))
            for r, p in enumerate(procs)]


def _silence(proc: Any, killed_at_deadline: bool, timeout_s: float) -> str:
    """Why a rank returned nothing: still running at the deadline, or it died on its own."""
    if killed_at_deadline:
        return f"no result within {timeout_s:g} s: still running at the deadline, killed"
    code = proc.exitcode
    if code is not None and code < 0:
        return f"it died from signal {-code} ({_signal_name(-code)}) before reporting a result"
    return f"it exited with status {code} before reporting a result"


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"
