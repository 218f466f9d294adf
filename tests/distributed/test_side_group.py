"""A side group beside the default world, as the vLLM worker extension joins it: the trainer (rank 0)
serves the store, a worker process whose own default world is already initialized joins it, and
the bucket stream crosses it through TorchDistTransport bit for bit; a worker that fails to load
drains the stream and reports, and an aborted stream reaches the worker as TransportAborted."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
from typing import Any

import pytest
import torch

from adapters.distributed.side_group import Rendezvous, SideGroup
from adapters.distributed.transport import TorchDistTransport
from domain.errors import TransportAborted
from domain.refit.buckets import pack_buckets, unpack_bucket

pytestmark = pytest.mark.distributed

BUCKET = 4096


def _named(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"layer{i}.weight", torch.randn(300 + 97 * i, generator=g).to(torch.bfloat16)) for i in range(8)]


def _worker(rv: dict[str, Any], mode: str, results: Any) -> None:
    # The worker's own world first, as vLLM makes one in every worker.
    import torch.distributed as dist

    with tempfile.NamedTemporaryFile(delete=False) as f:
        init = f"file://{f.name}"
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    group = SideGroup.join(Rendezvous.from_dict(rv), 1)
    transport = TorchDistTransport(group, source=0, rank=1, peers=group.ranks, bucket_bytes=BUCKET, timeout_s=120)
    out: list[Any] = []
    for refit in (1, 2):
        transport.refit_id = refit
        got: dict[str, bytes] = {}

        def consume(bucket: Any, got: dict[str, bytes] = got, refit: int = refit) -> None:
            if mode == "fail" and refit == 2 and bucket.index == 1:
                raise RuntimeError("the worker's load failed")
            for name, t in unpack_bucket(bucket):
                got[name] = t.contiguous().view(torch.uint8).numpy().tobytes()

        try:
            transport.receive(consume)
            out.append(("ok", got))
        except Exception as err:  # reported to the test
            out.append((type(err).__name__, str(err)))
    results.put((dist.get_world_size(), out))
    group.close()
    dist.destroy_process_group()
    os.unlink(init.removeprefix("file://"))


def _run(mode: str) -> tuple[int, list[Any], list[list[tuple[str, torch.Tensor]]]]:
    ctx = mp.get_context("spawn")
    # generous ceilings: a spawned worker on a busy machine takes tens of seconds to import torch and join
    rv, store = SideGroup.serve("127.0.0.1", 2, timeout_s=300)
    results = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(rv.to_dict(), mode, results))
    proc.start()
    group = SideGroup.join(rv, 0, store)
    transport = TorchDistTransport(group, source=0, rank=0, peers=group.ranks, bucket_bytes=BUCKET, timeout_s=120,
                                   window=1)
    sent = [_named(1), _named(2)]
    for refit, named in zip((1, 2), sent, strict=True):
        transport.refit_id = refit
        buckets = pack_buckets(named, BUCKET)
        if mode == "abort" and refit == 2:

            def aborting(buckets: Any = buckets) -> Any:
                for i, b in enumerate(buckets):
                    if i == 2:
                        raise RuntimeError("the trainer failed mid-stream")
                    yield b

            with pytest.raises(RuntimeError, match="mid-stream"):
                transport.send(aborting())
        else:
            transport.send(buckets)
    world, out = results.get(timeout=300)
    proc.join(120)
    group.close()
    return world, out, sent


def _bytes(named: list[tuple[str, torch.Tensor]]) -> dict[str, bytes]:
    return {n: t.view(torch.uint8).numpy().tobytes() for n, t in named}


def test_the_stream_crosses_a_side_group_bit_for_bit() -> None:
    world, out, sent = _run("ok")
    assert world == 1  # the worker's own default world is untouched
    assert [kind for kind, _ in out] == ["ok", "ok"]
    assert out[0][1] == _bytes(sent[0]) and out[1][1] == _bytes(sent[1])  # learning, then known layout


def test_a_failed_load_is_reported_after_the_stream_is_drained() -> None:
    _, out, sent = _run("fail")
    assert out[0] == ("ok", _bytes(sent[0]))
    assert out[1] == ("RuntimeError", "the worker's load failed")


def test_an_aborted_stream_reaches_the_worker_as_transport_aborted() -> None:
    _, out, _ = _run("abort")
    assert out[1][0] == TransportAborted.__name__ and "mid-stream" in out[1][1]


def test_rendezvous_is_checked() -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        Rendezvous("127.0.0.1", 1, 2, backend="mpi")
    with pytest.raises(ValueError, match="at least 2 members"):
        Rendezvous("127.0.0.1", 1, 1)
    rv = Rendezvous("127.0.0.1", 1234, 3, timeout_s=5.0)
    assert Rendezvous.from_dict(rv.to_dict()) == rv
