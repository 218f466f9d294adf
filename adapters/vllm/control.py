"""The control channel between a trainer and a vLLM engine host: JSON messages, one per line.

Requests are `{"op": NAME, ...}`; replies `{"ok": true, "result": ...}` or `{"ok": false, "error":
TYPE, "message": TEXT}`. Bytes (weights read back for diagnostics) travel base64-encoded as
`{"__bytes__": "..."}`. Bucket data never takes this channel: it goes over the side group.
"""

from __future__ import annotations

import base64
import json
import socket
from typing import Any

from adapters.vllm.errors import EngineProcessError

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
