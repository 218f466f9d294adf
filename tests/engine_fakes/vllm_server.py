"""A vLLM server's control plane over fake workers that run rl-refit's worker extension and its
rl_refit weight-transfer backend (adapters.vllm.session.WorkerSession), in this process: what the
attached vLLM engine (adapters.vllm.attached) drives. Worker calls cross as JSON text, as over
vLLM's HTTP `/collective_rpc`."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace
from typing import Any

import torch

from adapters.vllm.extension import RefitWorkerExtension
from adapters.vllm.protocol import from_json_safe, json_safe
from adapters.vllm.session import InitInfo, UpdateInfo, WorkerSession
from adapters.vllm.worker import WorkerRefit
from tests.engine_fakes.vllm import (
    FakeLayerwise,
    FakeVllmModel,
    fake_hooks,
    fake_log_probs,
    fake_worker_class,
)


class FakeBackend:
    """What vLLM's worker holds as `weight_transfer_engine`: here only its session."""

    def __init__(self, session: WorkerSession) -> None:
        self.session = session


class FakeServer:
    """A vLLM server's control plane over fake workers that run rl-refit's extension and backend
    (EngineControl). Worker calls cross as JSON text, as over vLLM's HTTP `/collective_rpc`."""

    where = "the fake server"
    same_host = True

    def __init__(self, models: list[FakeVllmModel], *, from_disk: bool = True, version: str | None = None,
                 quantization: str | None = None, quantization_config: dict[str, Any] | None = None,
                 kv_cache_dtype: str = "auto") -> None:
        cls = fake_worker_class(RefitWorkerExtension)
        self.models = models
        self.workers = []
        self.disk_loads = 0
        for rank, model in enumerate(models):
            worker = cls(model, FakeLayerwise(), rank)
            refit = WorkerRefit(model, None, fake_hooks(worker.layerwise))
            worker._rl_refit = refit
            session = WorkerSession(refit, rank=rank + 1, reload_from_disk=self._disk(model) if from_disk else None)
            worker.weight_transfer_engine = FakeBackend(session)
            worker.vllm_config = SimpleNamespace(
                model_config=SimpleNamespace(model="/models/fake", quantization=quantization,
                                             hf_config=SimpleNamespace(quantization_config=quantization_config)),
                cache_config=SimpleNamespace(cache_dtype=kv_cache_dtype),
                parallel_config=SimpleNamespace(world_size=len(models)),
                load_config=SimpleNamespace(load_format="auto" if from_disk else "dummy"))
            self.workers.append(worker)
        self.initial = [weights_of(m) for m in models]
        self.calls: list[str] = []
        self.paused = False
        self.version: str | None = None
        self.version_reported = version

    def _disk(self, model: FakeVllmModel):  # type: ignore[no-untyped-def]
        def reload() -> None:  # vLLM's reload_weights from the model path: the weights it started with
            self.disk_loads += 1
            i = self.models.index(model)
            with torch.no_grad():
                for name, t in model.named_parameters():
                    t.copy_(self.initial[i][name])
        return reload

    def sessions(self) -> list[WorkerSession]:
        return [w.weight_transfer_engine.session for w in self.workers]

    def collective_rpc(self, method: str, request: dict[str, Any]) -> list[Any]:
        self.calls.append(method)
        # as vLLM's HTTP route carries it (adapters.vllm.controls.HttpControl): JSON text, bytes base64
        answers = [getattr(w, method)(json.dumps(json_safe(request))) for w in self.workers]
        if self.version_reported is not None and method == "rl_refit_info":
            for a in answers:
                a["version"] = self.version_reported
        return [from_json_safe(a) for a in json.loads(json.dumps(answers))]

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append("init")
        for s in self.sessions():
            s.init(InitInfo.of(json.loads(json.dumps(init_info))))

    def start_weight_update(self) -> None:
        self.calls.append("start")
        for s in self.sessions():
            s.start()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.calls.append("update")
        errors: list[BaseException] = []

        def run(s: WorkerSession) -> None:
            try:
                s.update(UpdateInfo.of(update_info))
            except BaseException as err:
                errors.append(err)

        threads = [threading.Thread(target=run, args=(s,)) for s in self.sessions()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            raise RuntimeError(f"Internal Server Error: {errors[0]}")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")
        for s in self.sessions():
            s.finish()

    def pause(self, mode: str) -> None:
        self.calls.append(f"pause:{mode}")
        self.paused = True

    def resume(self) -> None:
        self.calls.append("resume")
        self.paused = False

    def reset_prefix_cache(self, reset_running_requests: bool) -> bool:
        self.calls.append("reset_prefix_cache")
        return True

    def set_weight_version(self, version: str) -> None:
        self.version = version

    def weight_version(self) -> str | None:
        return self.version

    def log_probs(self, input_ids: torch.Tensor, temperature: float = 1.0, lora: Any = None) -> torch.Tensor:
        for s in self.sessions():
            s.check_serving()
        return fake_log_probs(self.models[0])(input_ids, temperature)[0]

    def greedy(self, prompts: list[list[int]], max_tokens: int, lora: Any = None) -> list[list[int]]:
        return [[0] * max_tokens for _ in prompts]

    def close(self) -> None:
        self.calls.append("close")


def weights_of(model: FakeVllmModel) -> dict[str, torch.Tensor]:
    """A copy of a fake model's parameters, by name."""
    return {n: t.detach().clone() for n, t in model.named_parameters()}
