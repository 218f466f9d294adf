"""JSON over HTTP to a server rl-refit attaches to (vLLM's, SGLang's): one typed line for every way
a request fails, naming the server, the route and the key or flag that fixes it.

The standard library only (urllib): the trainer needs no HTTP package to attach.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

import attrs

from domain.errors import EngineUpdateFailed, ServerMismatch, ServerUnreachable


@attrs.frozen
class JsonServer:
    """A server's base URL and what its errors should say.

    Attributes:
        url: the base URL (`http://127.0.0.1:8000`).
        where: the server in words ("the vLLM server at ...").
        url_key: the configuration key that holds the URL (said when it does not answer).
        api_key: the server's API key (sent as a bearer token), or None.
        api_key_key: the configuration key of the API key (said on a 401 or 403).
        missing_route: what to do when a route is missing (404): the flag or mode that adds it.
        timeout_s: bound on each request.
    """

    url: str = attrs.field(converter=lambda u: str(u).rstrip("/"))
    where: str = ""
    url_key: str = "url"
    api_key: str | None = None
    api_key_key: str = "api_key"
    missing_route: str = ""
    timeout_s: float = 600.0

    def request(self, method: str, path: str, body: Any = None, *, query: Mapping[str, Any] | None = None,
                ok_codes: tuple[int, ...] = (200,), timeout_s: float | None = None) -> tuple[int, Any]:
        """(status, answer) of `method path`: the answer parsed as JSON (its text when it is not,
        None when empty). A status in `ok_codes` besides 2xx is returned too; any other raises:
        ServerMismatch for a missing route or a refused key, EngineUpdateFailed with the server's
        text otherwise, ServerUnreachable when nothing answered."""
        url = f"{self.url}{path}"
        if query:
            url += "?" + urllib.parse.urlencode({k: _query(v) for k, v in query.items()})
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s if timeout_s is None else timeout_s) as resp:
                return resp.status, _answer(resp.read())
        except urllib.error.HTTPError as err:
            raw = err.read()
            if err.code in ok_codes:
                return err.code, _answer(raw)
            if err.code == 404:
                raise ServerMismatch(f"{self.where} has no route {path}: {self.missing_route}") from None
            if err.code in (401, 403):
                raise ServerMismatch(f"{self.where} refused {path} ({err.code}): give its API key "
                                     f"({self.api_key_key})") from None
            text = raw.decode(errors="replace")[:2000]
            raise EngineUpdateFailed(f"{self.where} answered {err.code} to {method} {path}: {text}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise ServerUnreachable(f"{self.where} did not answer {method} {path}: {reason}; check the URL "
                                    f"({self.url_key}) and that the server is up") from None


def _query(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _answer(raw: bytes) -> Any:
    text = raw.decode(errors="replace")
    try:
        return json.loads(text) if text.strip() else None
    except ValueError:
        return text
