"""A source that breaks the wire format makes its receiver raise WireProtocolError and ends the
refit on every rank, cleanly: no rank dies in gloo, none hangs, the engine keeps its weights.

One world (trainer rank 0, engine rank 1, gloo on 127.0.0.1) runs every scenario of
tests/distributed/bad_peers.py on fresh process groups: oversized, negative, out-of-order and
after-last headers, sizes that disagree with the tensors, and payloads longer or shorter than
announced, both while the receiver learns the stream layout and once it knows it.
"""

from __future__ import annotations

import pytest

from adapters.distributed.launch import launch_world
from tests.distributed import bad_peers

pytestmark = pytest.mark.distributed
SCENARIOS = {**bad_peers.LEARNING, **bad_peers.KNOWN}


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    runs = launch_world(bad_peers.bad_peer_rank, 2, (list(SCENARIOS),), timeout_s=240)
    died = [f"rank {r.rank}: {r.error}\n{r.traceback or ''}\n{r.output}" for r in runs if not r.ok]
    assert not died, "\n".join(died)  # a rank that died in gloo or hung past the bound shows here
    return {s: [runs[rank].value[i] for rank in (0, 1)] for i, s in enumerate(SCENARIOS)}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_malformed_stream_aborts_the_refit_on_every_rank(results: dict[str, list[dict]], scenario: str) -> None:
    trainer, engine = results[scenario]
    for rec in (trainer, engine):
        assert rec["raised"] == "DistributedRefitFailed", rec  # the agreed abort, not a timeout or a lost peer
    assert trainer["text"] == engine["text"]  # every rank tells the same story
    text = engine["text"]
    assert "rank 1" in text and "WireProtocolError" in text, text
    assert SCENARIOS[scenario] in text, text


@pytest.mark.parametrize("scenario", list(bad_peers.KNOWN))
def test_the_engine_keeps_its_weights(results: dict[str, list[dict]], scenario: str) -> None:
    engine = results[scenario][1]
    assert engine["kept"] is True and engine["stale"] is False, engine
