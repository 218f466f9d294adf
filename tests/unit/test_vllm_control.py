"""The engine host's control channel: JSON lines both ways, bytes kept, and every way a peer can
fail (closing, going silent, sending garbage) a typed EngineProcessError naming it."""

from __future__ import annotations

import socket

import pytest

from adapters.vllm.control import Channel
from adapters.vllm.errors import EngineProcessError


@pytest.fixture
def pair():  # type: ignore[no-untyped-def]
    a, b = socket.socketpair()
    # each end is named for the peer it talks to, as the errors read: `left` is the left end's
    # channel (its peer is "right"), `right` the right end's (its peer is "left")
    left, right = Channel(a, "right"), Channel(b, "left")
    yield left, right
    left.close()
    right.close()


def test_messages_cross_intact_bytes_included(pair) -> None:  # type: ignore[no-untyped-def]
    left, right = pair
    message = {"op": "rpc", "args": [1, 2.5, "x", None, [True]], "blob": b"\x00\xffbytes", "nested": {"b": bytearray(b"ab")}}
    left.send(message)
    got = right.receive(5)
    assert got == {"op": "rpc", "args": [1, 2.5, "x", None, [True]], "blob": b"\x00\xffbytes", "nested": {"b": b"ab"}}


def test_a_closed_peer_is_named(pair) -> None:  # type: ignore[no-untyped-def]
    left, right = pair
    left.close()
    with pytest.raises(EngineProcessError, match="left closed the control connection"):
        right.receive(5)


def test_a_silent_peer_times_out(pair) -> None:  # type: ignore[no-untyped-def]
    _, right = pair
    with pytest.raises(EngineProcessError, match=r"left did not answer within 0\.2 s"):
        right.receive(0.2)


@pytest.mark.parametrize(("raw", "match"), [(b"not json\n", "malformed"), (b"[1, 2]\n", "not an object")])
def test_garbage_is_refused(pair, raw: bytes, match: str) -> None:  # type: ignore[no-untyped-def]
    left, right = pair
    left.sock.sendall(raw)
    with pytest.raises(EngineProcessError, match=match):
        right.receive(5)
