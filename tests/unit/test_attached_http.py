"""The attached engine's HTTP control plane and the guardian, against a small HTTP server on
loopback that answers like vLLM's (or fails like a misconfigured one)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from adapters.vllm.attached import Expected, probe
from adapters.vllm.controls import HttpControl
from adapters.vllm.guardian import Guardian
from domain.errors import ServerMismatch, ServerUnreachable


class FakeVllmHttp:
    """Records every request; answers from `routes` (path -> (status, body)); 404 otherwise."""

    def __init__(self, routes: dict[str, tuple[int, Any]]) -> None:
        self.routes = routes
        self.requests: list[tuple[str, Any]] = []
        self.changed = threading.Condition()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                with fake.changed:
                    fake.requests.append((self.path, body))
                    fake.changed.notify_all()
                status, answer = fake.routes.get(self.path.split("?")[0], (404, {"detail": "Not Found"}))
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def paths(self) -> list[str]:
        return [p.split("?")[0] for p, _ in self.requests]

    def wait_for(self, path: str, timeout_s: float = 60.0) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: path in self.paths(), timeout_s)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake() -> Iterator[FakeVllmHttp]:
    server = FakeVllmHttp({})
    yield server
    server.close()


def test_a_url_nothing_listens_on_is_one_line_naming_it() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with pytest.raises(ServerUnreachable, match=rf"127\.0\.0\.1:{port}.*rollout\.engine_kwargs\.vllm\.url") as info:
        HttpControl(f"http://127.0.0.1:{port}", timeout_s=60).collective_rpc("rl_refit_info", {})
    assert "\n" not in str(info.value)


def test_a_server_without_dev_mode_is_told_to_set_it(fake: FakeVllmHttp) -> None:
    fake.routes["/health"] = (200, {})
    with pytest.raises(ServerMismatch, match="VLLM_SERVER_DEV_MODE=1"):
        probe(HttpControl(fake.url), Expected())


def test_a_server_without_the_extension_is_told_the_flag(fake: FakeVllmHttp) -> None:
    fake.routes["/collective_rpc"] = (500, {"error": "AttributeError: 'CPUWorker' object has no attribute 'rl_refit_info'"})
    with pytest.raises(ServerMismatch, match=r"--worker-extension-cls adapters\.vllm\.extension\.RefitWorkerExtension"):
        probe(HttpControl(fake.url), Expected())


def test_worker_calls_cross_as_json_text_as_vllms_http_collective_rpc_requires(fake: FakeVllmHttp) -> None:
    fake.routes["/collective_rpc"] = (200, {"results": [{"record": "Done"}]})
    assert HttpControl(fake.url).collective_rpc("rl_refit_commit", {"record": "Commit", "token": "t"}) == [{"record": "Done"}]
    _, body = fake.requests[-1]
    assert body["method"] == "rl_refit_commit"
    assert [json.loads(a) for a in body["args"]] == [{"record": "Commit", "token": "t"}]


def test_pause_keeps_requests_by_default_and_reset_says_whether_it_dropped_the_cache(fake: FakeVllmHttp) -> None:
    fake.routes.update({"/pause": (200, {"status": "paused"}), "/reset_prefix_cache": (200, {"success": False})})
    control = HttpControl(fake.url)
    control.pause("keep")
    assert fake.requests[-1][0] == "/pause?mode=keep"
    assert control.reset_prefix_cache(True) is False
    assert fake.requests[-1][0] == "/reset_prefix_cache?reset_running_requests=true"


_RESCUE = ("/collective_rpc", "/reset_prefix_cache", "/resume")


def _rescue_routes(fake: FakeVllmHttp) -> None:
    fake.routes.update({"/collective_rpc": (200, {"results": [{"record": "Restored", "restored": True}]}),
                        "/reset_prefix_cache": (200, {"success": True}), "/resume": (200, {"status": "resumed"})})


def test_the_guardian_restores_and_resumes_a_server_whose_trainer_vanished_mid_refit(fake: FakeVllmHttp) -> None:
    _rescue_routes(fake)
    guardian = Guardian.start(fake.url, "a" * 32)
    guardian.begin()
    assert guardian.pipe is not None
    guardian.pipe.close()  # what the trainer's death does to the pipe, whatever killed it
    assert fake.wait_for("/resume")
    assert guardian.proc.wait(timeout=60) == 0
    assert fake.paths() == list(_RESCUE)
    restore = json.loads(fake.requests[0][1]["args"][0])
    assert restore["record"] == "Restore" and restore["token"] == "a" * 32
    # the guardian imports the standard library only and spells the request itself: it is the
    # protocol's record, as the worker extension reads it
    from adapters.vllm import protocol as p

    assert fake.requests[0][1]["method"] == p.Restore.METHOD and p.Restore.ACCESS is p.Access.SESSION
    assert p.Restore.from_plain({k: v for k, v in restore.items() if k != p.TOKEN}).reason


def test_the_guardian_leaves_a_server_alone_between_refits(fake: FakeVllmHttp) -> None:
    _rescue_routes(fake)
    guardian = Guardian.start(fake.url, "a" * 32)
    guardian.begin()
    guardian.end()
    guardian.close()
    assert guardian.proc.returncode == 0
    assert fake.requests == []
