"""SGLang 0.5.23's HTTP routes for a refit, over the in-process FakeSglangEngine, on loopback.

Each route reads its body as SGLang's request struct (sglang/srt/managers/io_struct.py) and answers
as sglang/srt/entrypoints/http_server.py does:

- /update_weights_from_tensor: every rank's payload is base64 text; the scheduler deserializes its
  own rank's (rank 0 here) with SGLang's SafeUnpickler (adapters.sglang.serializer.deserialize, the
  port) and hands the tensors to the custom loader named by load_format. An exception from the
  loader, or a load_format that is no registered loader, is not caught in SGLang: its scheduler
  process stops and the server goes down; here the server stops answering (`dead`).
- /flush_cache refuses (400) while requests are in flight (`busy_flushes` refusals, then succeeds).
- /pause_generation, /continue_generation: the pause state; `events` records every route called.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlparse

from adapters.sglang.serializer import deserialize
from tests.engine_fakes.sglang import FakeSglangEngine

PAUSE_MODES = ("abort", "retract", "in_place")  # PauseGenerationReqInput.mode
TENSOR_FIELDS = {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests", "weight_version",
                 "selector", "torch_empty_cache"}  # UpdateWeightsFromTensorReqInput


class FakeSglangServer:
    """A loopback HTTP server answering SGLang's refit routes for `engine`."""

    def __init__(self, engine: FakeSglangEngine, *, tp_size: int = 1, model_path: str = "/ckpt/fake",
                 routes: bool = True, quantization: str | None = None) -> None:
        self.engine = engine
        self.tp_size = tp_size
        self.model_path = model_path
        self.quantization = quantization  # the server's --quantization
        self.routes = routes  # False: a server without the weight routes (an older or another server)
        self.paused: str | None = None
        self.busy_flushes = 0
        self.events: list[str] = []
        self.payloads: list[int] = []  # how many rank payloads each update carried
        self.dead = False
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return None

            def do_GET(self) -> None:
                server.handle(self, "GET")

            def do_POST(self) -> None:
                server.handle(self, "POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> FakeSglangServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- routes ---

    def handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        if self.dead:  # the scheduler stopped: the whole server is gone
            h.close_connection = True
            return
        path = urlparse(h.path).path
        length = int(h.headers.get("Content-Length") or 0)
        body = json.loads(h.rfile.read(length) or b"{}") if length else {}
        with self.lock:
            self.events.append(path)
            try:
                status, answer = self.route(method, path, body)
            except _SchedulerDied:
                self.dead = True
                h.close_connection = True
                return
        data = answer.encode() if isinstance(answer, str) else json.dumps(answer).encode()
        h.send_response(status)
        h.send_header("Content-Type", "text/plain" if isinstance(answer, str) else "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def route(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        weight_routes = ("/begin_weight_update", "/end_weight_update", "/update_weights_from_tensor",
                         "/pause_generation", "/continue_generation", "/flush_cache")
        if path in weight_routes and not self.routes:
            return 404, {"detail": "Not Found"}
        if path == "/server_info" and method == "GET":
            return 200, {"custom_weight_loader": list(self.engine.custom_weight_loaders), "tp_size": self.tp_size,
                         "model_path": self.model_path, "quantization": self.quantization, "version": "0.5.23"}
        if path == "/health":
            return 200, ""
        if path == "/pause_generation":
            mode = body.get("mode", "abort")
            if mode not in PAUSE_MODES:
                return 422, {"detail": f"mode {mode!r}"}
            self.paused = mode
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
        if path == "/continue_generation":
            self.paused = None
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        if path == "/flush_cache":
            if self.busy_flushes > 0:
                self.busy_flushes -= 1
                return 400, "Flush cache failed.\n"
            self.engine.flush_cache()
            return 200, "Cache flushed.\n"
        if path == "/begin_weight_update":
            return _result(*self.engine.begin_weight_update())
        if path == "/end_weight_update":
            return _result(*self.engine.end_weight_update())
        if path == "/update_weights_from_tensor":
            return self.update_weights_from_tensor(body)
        return 404, {"detail": "Not Found"}

    def update_weights_from_tensor(self, body: dict[str, Any]) -> tuple[int, Any]:
        unknown = set(body) - TENSOR_FIELDS
        payloads = body.get("serialized_named_tensors")
        if unknown or not isinstance(payloads, list) or len(payloads) != self.tp_size:
            return 422, {"detail": f"unknown fields {sorted(unknown)} or not one payload per rank"}
        self.payloads.append(len(payloads))
        if not self.engine.session:
            return 400, {"success": False, "message": "update_weights_from_tensor must run between "
                         "begin_weight_update() and end_weight_update()"}
        # every TP rank deserializes its own payload (TpModelWorker.deserialize_own_rank); rank 0's is loaded
        named, *_ = [deserialize(p) for p in payloads]
        load_format = body.get("load_format")
        if load_format is not None and load_format not in self.engine.custom_weight_loaders:
            raise _SchedulerDied(f"Unknown load_format={load_format}")
        try:
            ok, message = self.engine.update_weights_from_tensor(named, load_format, bool(body.get("flush_cache")))
        except Exception as err:  # SGLang does not catch a loader's exception: its scheduler stops
            raise _SchedulerDied(str(err)) from err
        return _result(ok, message)


class _SchedulerDied(Exception):
    pass


def _result(ok: bool, message: str) -> tuple[int, dict[str, Any]]:
    return (200 if ok else 400), {"success": ok, "message": message}


def main() -> None:
    """Serve a fake SGLang engine in a process of its own (tests: tensors then cross processes):
    `python -m tests.engine_fakes.sglang_server LINEAR MOE` prints its URL, then serves until stdin
    closes. GET /rl_refit_test/weights answers the model's tensors (torch.save, base64)."""
    import base64
    import io
    import sys

    import torch

    from tests.engine_fakes.sglang import FakeSglangModel

    linear, moe = (None if a == "none" else a for a in sys.argv[1:3])
    torch.manual_seed(0)
    model = FakeSglangModel(linear=linear, moe=moe)
    server = FakeSglangServer(FakeSglangEngine(model))
    route = server.route

    def with_weights(method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        if path == "/rl_refit_test/weights":
            buf = io.BytesIO()
            torch.save({n: t.detach().clone() for n, t in model.state_dict().items()}, buf)
            return 200, {"weights": base64.b64encode(buf.getvalue()).decode()}
        return route(method, path, body)

    server.route = with_weights  # type: ignore[method-assign]
    print(server.url, flush=True)
    sys.stdin.read()
    server.close()


if __name__ == "__main__":
    main()
