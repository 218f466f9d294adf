"""An SGLang server the user started, refitted over SGLang's own HTTP API (rollout.deployment:
attached): `HttpClient` is the SglangClient seam of SglangRolloutEngine over that API.

    begin:  POST /pause_generation -> POST /begin_weight_update
    each:   POST /update_weights_from_tensor (load_format: rl-refit's loader, LOADER_PATH)
            carrying the BEGIN marker, the buckets, then the FINAL (or ABORT) marker
    end:    POST /end_weight_update -> POST /flush_cache (retried: SGLang refuses while requests
            are in flight) -> POST /continue_generation

Generation is paused around every refit, never optionally; a refit that fails is restored by
the loader from its backup and the server continues on its previous weights. A restore that
failed leaves the server paused (it would serve half-written weights), and the engine stale.

The tensors do not travel in the HTTP body: it carries handles to shared memory (see
adapters.sglang.serializer), so the server runs on this host, as this user (docs/attach.md).

Never `/update_weights_from_distributed`: it writes the parameters from a process group without
calling any loader, so nothing backs them up and a failed refit could not be undone.

sglang is not imported: the routes' request bodies are written as SGLang 0.5.23 reads them
(adapters/sglang/api.py lists them for the conformance test).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import attrs
import structlog
import torch

from adapters.engine_start import same_model
from adapters.sglang.engine import NamedTensors, SglangRolloutEngine
from adapters.sglang.serializer import serialize
from adapters.sglang.staging import LOADER_PATH
from adapters.sglang.status import LoaderStatus
from adapters.system.http import JsonServer
from domain.errors import EngineUpdateFailed, ServerMismatch, ServerUnreachable
from domain.quant.plan import QuantizationPlan
from domain.refit.storage import StorageFingerprint

log = structlog.get_logger()

# SGLang's PauseGenerationReqInput.mode values.
PAUSE_MODES = ("retract", "in_place", "abort")
FLUSH_TRIES = 20


@attrs.define
class HttpClient:
    """An SGLang server over its HTTP API (the SglangClient seam).

    Attributes:
        url: the server's base URL (`http://127.0.0.1:30000`).
        pause_mode: SGLang's pause mode around a refit: retract (in-flight requests go back to the
            queue and continue after the refit, their KV recomputed with the new weights), in_place
            (they freeze on their old KV; the cache flush is then refused while they run) or abort.
        api_key: the server's --api-key / --admin-api-key, when it has one.
        timeout_s: bound on each request (a bucket's load included).
        tp_size: the server's tensor-parallel size (one payload per rank), read by `probe`.
    """

    url: str = attrs.field(converter=lambda u: str(u).rstrip("/"))
    pause_mode: str = attrs.field(default="retract", validator=attrs.validators.in_(PAUSE_MODES))
    api_key: str | None = None
    timeout_s: float = 600.0
    tp_size: int = 1
    flush_tries: int = FLUSH_TRIES
    status: LoaderStatus = attrs.field(init=False)  # what the loader did with each call
    paused: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        self.status = LoaderStatus(self.where)

    @property
    def where(self) -> str:
        return f"the SGLang server at {self.url}"

    # --- requests -------------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, *, query: Mapping[str, Any] | None = None,
                ok_codes: tuple[int, ...] = (200,)) -> tuple[int, Any]:
        """(status, answer) of `method path` (adapters.system.http.JsonServer: the JSON answer, else
        its text; a status outside `ok_codes` raises, one typed line)."""
        server = JsonServer(self.url, self.where, "rollout.engine_kwargs.sglang.url", self.api_key,
                            "--api-key / --admin-api-key: rollout.engine_kwargs.sglang.api_key",
                            f"attach to an SGLang {_PINNED} server (python -m sglang.launch_server)", self.timeout_s)
        return server.request(method, path, body, query=query, ok_codes=ok_codes)

    def _post(self, path: str, body: Any) -> tuple[bool, str]:
        """A weight route's (success, message): 200 or 400 with SGLang's {"success", "message"}."""
        status, answer = self.request("POST", path, body, ok_codes=(200, 400))
        if isinstance(answer, dict):
            return bool(answer.get("success", status == 200)), str(answer.get("message", ""))
        return status == 200, str(answer or "")

    # --- the probe ------------------------------------------------------------------------------

    def probe(self, model: str | None = None, quantization: str | None = None,
              server_flags: str = "") -> dict[str, Any]:
        """The server's /server_info, after checking rl-refit can refit it: its custom weight
        loaders include rl-refit's, it serves `model` (when given) with the plan's `quantization`
        method (None: BF16; `server_flags` start it for the plan). Sets `tp_size`."""
        _, info = self.request("GET", "/server_info")
        if not isinstance(info, dict):
            raise ServerMismatch(f"{self.where} answered /server_info with {str(info)[:200]!r}: attach to an "
                                 f"SGLang {_PINNED} server")
        loaders = info.get("custom_weight_loader") or []
        if LOADER_PATH not in loaders:
            raise ServerMismatch(f"{self.where} runs without rl-refit's weight loader: start it with "
                                 f"--custom-weight-loader {LOADER_PATH} (rl-refit installed in its environment)")
        served = info.get("model_path")
        if model is not None and served is not None and not same_model(str(served), model):
            raise ServerMismatch(f"{self.where} serves {served!r}, not {model!r} (model.path): attach to the "
                                 "server of this model, or set model.path to the served one")
        if (info.get("quantization") or None) != (quantization or None):
            flags = f" ({server_flags})" if server_flags else ""
            raise ServerMismatch(f"{self.where} was started with quantization={info.get('quantization')!r}, but the "
                                 f"plan needs {quantization!r}: restart the server with the plan's flags{flags}, or "
                                 "change rollout.quantization to what the server serves")
        self.tp_size = int(info.get("tp_size") or 1)
        return info

    # --- SglangClient -----------------------------------------------------------------------------

    def begin_weight_update(self) -> tuple[bool, str]:
        self.request("POST", "/pause_generation", {"mode": self.pause_mode})
        self.paused = True
        try:
            ok, message = self._post("/begin_weight_update", {})
        except BaseException:
            self._continue()
            raise
        if not ok:
            self._continue()
        return ok, message

    def update_weights_from_tensor(self, named_tensors: NamedTensors, load_format: str,
                                   flush_cache: bool) -> tuple[bool, str]:
        named = self.status.outgoing(named_tensors)
        refused = self.status.refused()
        if refused is not None:
            return refused
        body = {"serialized_named_tensors": [serialize(named) for _ in range(self.tp_size)],
                "load_format": load_format, "flush_cache": False}  # flushed once, at the end, retried
        ok, message = self._post("/update_weights_from_tensor", body)
        if not ok:
            return False, message
        return self.status.outcome()

    def end_weight_update(self) -> tuple[bool, str]:
        ok, message = self._post("/end_weight_update", {})
        if self.status.unrestored is not None:
            log.error("the SGLang server could not restore its weights; it stays paused", where=self.where,
                      why=self.status.unrestored)
            return False, f"{message}; {self.where} stays paused: {self.status.unrestored}"
        self.flush_cache()
        self._continue()
        return ok, message

    def flush_cache(self) -> tuple[bool, str]:
        """Drop the radix cache (KV computed with older weights), retried while SGLang refuses
        (requests in flight)."""
        message = ""
        for attempt in range(self.flush_tries):
            status, answer = self.request("POST", "/flush_cache", ok_codes=(200, 400))
            if status == 200:
                return True, "Success"
            message = str(answer)
            time.sleep(min(0.05 * 2**attempt, 1.0))
        log.warning("the SGLang server kept its radix cache after a refit", where=self.where, message=message)
        return False, message

    def _continue(self) -> None:
        self.request("POST", "/continue_generation", {})
        self.paused = False

    def storage_fingerprint(self) -> StorageFingerprint:
        return StorageFingerprint({})  # the server's pointers are not visible here (the loader checks them)

    def live_weights(self) -> Mapping[str, torch.Tensor]:
        raise NotImplementedError("an SGLang server's tensors are not visible from the trainer")

    def close(self) -> None:
        """Let go of the server (it keeps running): continue generation if this client paused it
        and the weights are whole."""
        if self.paused and self.status.unrestored is None:
            try:
                self._continue()
            except (ServerUnreachable, ServerMismatch, EngineUpdateFailed) as err:
                log.warning("could not continue the SGLang server's generation", where=self.where, error=str(err))
        self.status.close()


_PINNED = "0.5.23"




@attrs.define
class AttachedSglangEngine(SglangRolloutEngine):
    """SglangRolloutEngine over an HttpClient, with `close()` (the server keeps running)."""

    def close(self) -> None:
        close = getattr(self.client, "close", None)
        if close is not None:
            close()


def attach(url: str, plan: QuantizationPlan, *, model: str | None = None, quantization: str | None = None,
           server_flags: str = "", pause_mode: str = "retract",
           api_key: str | None = None, native_mxfp8: bool = False, sync_backend: str | None = None,
           wire_format: str | None = None, timeout_s: float = 600.0) -> AttachedSglangEngine:
    """An engine over the SGLang server at `url`, which the user started, after probing it.

    Args:
        url: the server's base URL.
        plan: the rollout plan (the server must have been started for it).
        model: the model path it should serve (None: not checked).
        quantization: SGLang's `quantization` method the plan needs (None: BF16).
        server_flags: the server arguments that start a server for the plan (said when it differs).
        pause_mode: SGLang's pause mode around a refit (retract, in_place, abort).
        api_key: the server's API key, if any.
        native_mxfp8: the dispatch chose SGLang's native MXFP8 layout.
        sync_backend: rollout.checkpoint_engine.backend.
        wire_format: rollout.wire_format.
        timeout_s: bound on each request.
    """
    client = HttpClient(url, pause_mode=pause_mode, api_key=api_key, timeout_s=timeout_s)
    client.probe(model, quantization, server_flags)
    return AttachedSglangEngine(client, plan, native_mxfp8=native_mxfp8, sync_backend=sync_backend,
                                wire_format=wire_format)
