"""A cold start in one process (adapters.vllm.cold_start, what `refit demo vllm` compares refits
with) and the test suite's (tests.vllm.cold_host: one process forked per cold start, serving the
same way) serve what a vLLM server of the same export serves: every parameter's bytes, the KV-cache
scales, the prompt log-probs and the greedy tokens, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="needs the vLLM environment (.venv-vllm), which `make test` creates")

from adapters.vllm.cold_start import ColdProcess
from adapters.vllm.factory import vllm_cold_server
from app.bootstrap import bootstrap
from app.services.demo_config import engine_config, with_engine_args
from app.services.engine_demo import EngineDemoSettings
from domain.quant.plan import QuantizationPlan
from tests.vllm.cold_host import ForkedColdStart, with_cold_host
from tests.vllm.scenarios import EXTENSION


def _served(cold: object, ids: torch.Tensor, prompts: list[list[int]]) -> dict[str, object]:
    try:
        digests = cold.digests()  # type: ignore[attr-defined]
        return {"digests": digests, "log_probs": cold.log_probs(ids), "tokens": cold.greedy(prompts, 4),  # type: ignore[attr-defined]
                "placeholders": cold.placeholders(digests), "kv_scales": cold.kv_scales()}  # type: ignore[attr-defined]
    finally:
        cold.close()  # type: ignore[attr-defined]


@pytest.mark.slow
def test_a_cold_start_in_one_process_serves_what_a_cold_server_serves(cold_host: str, tmp_path: Path) -> None:
    """ModelOpt's per-token NVFP4 experts on micro-moe: a quantization_config passed as an engine
    argument, the CPU emulation kernels, and activation scales the export carries none of."""
    plan = QuantizationPlan.from_presets(None, "NVFP4")
    settings = EngineDemoSettings(deployment="colocated", plan=plan, model="micro-moe")
    services = bootstrap(with_engine_args(engine_config(settings, 0.25), start_timeout_s=900, worker_extension_cls=EXTENSION))
    trainer = services.trainer_model()
    services.embedded.export_trainer(trainer, tmp_path / "export")
    ids = torch.randint(0, trainer.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    prompts = [row[:6] for row in ids.tolist()]

    forked_start = with_cold_host(services).engines.cold_start(tmp_path / "export")
    assert isinstance(forked_start, ForkedColdStart)  # the host answered
    own_start = services.engines.cold_start(tmp_path / "export")
    assert isinstance(own_start, ColdProcess)  # one worker: one process, not a server
    engines = services.engines
    served = {"forked": _served(forked_start, ids, prompts), "one process": _served(own_start, ids, prompts),
              "server": _served(vllm_cold_server(engines.config.rollout.engine_kwargs.vllm, engines.engine_start("vllm"),
                                                 engines.engine_host(), str(tmp_path / "export")), ids, prompts)}
    assert not own_start.log_path.exists()  # removed after a clean run

    server = served.pop("server")
    assert len(server["digests"]) > 0 and server["placeholders"] and server["kv_scales"]  # type: ignore[arg-type]
    for name, cold in served.items():
        assert cold["digests"] == server["digests"], name
        assert torch.equal(cold["log_probs"], server["log_probs"]), name  # type: ignore[arg-type]
        assert cold["tokens"] == server["tokens"], name
        assert cold["placeholders"] == server["placeholders"] and cold["kv_scales"] == server["kv_scales"], name
