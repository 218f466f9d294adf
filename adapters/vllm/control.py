"""The control channel between a trainer and a vLLM engine host: JSON messages, one per line.

Every message is a record of adapters.vllm.protocol's kind (a dict of plain values tagged with
its name): the host's `Hello` when its engine started (or did not), then one request from the
trainer (HOST_REQUESTS) and one reply from the host at a time, the request's reply record or an
ErrorReply. Bytes (weights read back for diagnostics) travel base64-encoded as
`{"__bytes__": "..."}`. Bucket data never takes this channel: it goes over the side group.
"""

from __future__ import annotations

import base64
import json
import socket
from typing import Any, ClassVar, Generic

import attrs

from adapters.vllm.errors import EngineProcessError
from adapters.vllm.protocol import Done, R, Record, tuple_of


@attrs.frozen
class Hello(Record):
    """The host's first message: the trainer's token, then its pid and what each worker reported
    (ReadyReply records, plain), or why its engine did not start (an ErrorReply, plain)."""

    token: str = attrs.field(converter=str)
    pid: int = attrs.field(converter=int, default=0)
    workers: tuple[Any, ...] = attrs.field(converter=tuple_of, default=())
    error: dict[str, Any] | None = None


class HostRequest(Record, Generic[R]):
    """A request to the engine host and the record of its reply."""

    REPLY: ClassVar[type[Record]]


@attrs.frozen
class WorkerAnswers(Record):
    """Every worker's plain answer to one worker request (a reply record or an ErrorReply each)."""

    answers: tuple[Any, ...] = attrs.field(converter=tuple_of)


@attrs.frozen
class CallWorkers(HostRequest[WorkerAnswers]):
    """`LLM.collective_rpc(method, args=(request,))`: one protocol request to every worker."""

    REPLY: ClassVar[type[Record]] = WorkerAnswers

    method: str = attrs.field(converter=str)
    request: dict[str, Any] = attrs.field(converter=dict)


@attrs.frozen
class LogProbsReply(Record):
    rows: tuple[Any, ...] = attrs.field(converter=tuple_of)


@attrs.frozen
class HostLogProbs(HostRequest[LogProbsReply]):
    """Prompt log-probs of each row of `input_ids` (one [T-1] row of floats per prompt)."""

    REPLY: ClassVar[type[Record]] = LogProbsReply

    input_ids: tuple[Any, ...] = attrs.field(converter=tuple_of)
    temperature: float = attrs.field(converter=float, default=1.0)
    lora: list[Any] | None = None  # the adapter to serve with (adapters.vllm.lora.LoraServing, plain)


@attrs.frozen
class Tokens(Record):
    tokens: tuple[Any, ...] = attrs.field(converter=tuple_of)


@attrs.frozen
class HostGreedy(HostRequest[Tokens]):
    """Greedy continuations of token-id prompts."""

    REPLY: ClassVar[type[Record]] = Tokens

    prompts: tuple[Any, ...] = attrs.field(converter=tuple_of)
    max_tokens: int = attrs.field(converter=int)
    lora: list[Any] | None = None  # the adapter to serve with (adapters.vllm.lora.LoraServing, plain)


@attrs.frozen
class ResetPrefixCache(HostRequest[Done]):
    """Drop every prefix-cache entry (those of a replaced LoRA adapter among them)."""

    REPLY: ClassVar[type[Record]] = Done


@attrs.frozen
class Shutdown(HostRequest[Done]):
    """Reply, then exit."""

    REPLY: ClassVar[type[Record]] = Done


HOST_REQUESTS: dict[str, type[HostRequest[Any]]] = {
    cls.__name__: cls for cls in (CallWorkers, HostLogProbs, HostGreedy, ResetPrefixCache, Shutdown)}

MAX_LINE = 1 << 31  # a line is one message; diagnostics (live weights) can be large


def _encode(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__bytes__"}:
            return base64.b64decode(value["__bytes__"])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


class Channel:
    """One end of a control connection."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self._reader = sock.makefile("rb")

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(_encode(message), separators=(",", ":")).encode() + b"\n"
        try:
            self.sock.sendall(data)
        except OSError as err:
            raise EngineProcessError(f"the control connection to {self.peer} broke while sending: {err}") from err

    def receive(self, timeout_s: float | None) -> dict[str, Any]:
        """The next message; EngineProcessError when the peer closes, goes silent past `timeout_s`
        (None = wait for ever) or sends something that is not a message."""
        self.sock.settimeout(timeout_s)
        try:
            line = self._reader.readline(MAX_LINE)
        except TimeoutError as err:
            raise EngineProcessError(f"{self.peer} did not answer within {timeout_s:g} s") from err
        except OSError as err:
            raise EngineProcessError(f"the control connection to {self.peer} broke: {err}") from err
        if not line:
            raise EngineProcessError(f"{self.peer} closed the control connection")
        try:
            message = _decode(json.loads(line))
        except ValueError as err:
            raise EngineProcessError(f"{self.peer} sent a malformed control message: {line[:200]!r}") from err
        if not isinstance(message, dict):
            raise EngineProcessError(f"{self.peer} sent a control message that is not an object: {line[:200]!r}")
        return message

    def close(self) -> None:
        try:
            self._reader.close()
            self.sock.close()
        except OSError:
            pass
