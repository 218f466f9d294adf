"""Refits into a vLLM server started the way a user starts one (tests.vllm.servers: a separate
process, dev mode, loopback, `--weight-transfer-config '{"backend": "rl_refit"}'`), attached to by
rl-refit (`rollout.deployment: attached`), by vLLM's own weight-sync client, and as an AsyncLLM.

Every live refit is compared with a cold start of the same export (the engine host, cached by the
export's digest across tests): prompt log-probs through the server's OpenAI API, greedy tokens,
and every parameter vLLM keeps readable, bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from tests.vllm.cold_host import with_cold_host
from tests.vllm.servers import ROOT, StreamingClient, server_environment, vllm_server

pytest.importorskip("vllm", reason="needs the vLLM environment (.venv-vllm), which `make test` creates")

from app.bootstrap import bootstrap
from app.services.demo_config import engine_config, with_engine_args
from app.services.engine_demo import ColdStartComparer, EngineDemoSettings
from domain.errors import RefitFailed, RefitIncomplete
from domain.quant.plan import QuantizationPlan
from domain.refit.report import RefitOutcome

RECOVERY_CEILING_S = 30.0  # the bound: a dead trainer's server serves again within it


def _settings(preset: str | None) -> EngineDemoSettings:
    return EngineDemoSettings(deployment="attached", plan=QuantizationPlan.from_presets(preset, preset),
                              model="micro-dense")


def _config(settings: EngineDemoSettings, url: str | None = None) -> Any:
    # cold starts: two engines starting at once on two loaded cores
    return with_engine_args(engine_config(attrs.evolve(settings, url=url), 0.25), start_timeout_s=900)


def _shm_rings() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("rl-refit-shm-*")} if Path("/dev/shm").is_dir() else set()


@attrs.define
class Started:
    """A server of the embedded model's first export, and what the test attaches with."""

    server: Any
    settings: EngineDemoSettings
    trainer: Any
    model: str


@pytest.fixture(scope="module")
def bf16(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Started]:
    with _start(tmp_path_factory, None) as started:
        yield started


def _export(tmp_path_factory: pytest.TempPathFactory, preset: str | None) -> tuple[EngineDemoSettings, Any, Path]:
    """The embedded model's trainer and its first export (what the user serves: the checkpoint)."""
    settings = _settings(preset)
    services = bootstrap(_config(settings))
    trainer = services.trainer_model()
    start = tmp_path_factory.mktemp("start") / "export"
    services.embedded.export_trainer(trainer, start)
    return settings, trainer, start


@contextlib.contextmanager
def _start(tmp_path_factory: pytest.TempPathFactory, preset: str | None) -> Iterator[Started]:
    settings, trainer, start = _export(tmp_path_factory, preset)
    with vllm_server(start, tmp_path_factory.mktemp("logs")) as server:
        yield Started(server, settings, trainer, str(start))


def _attach(started: Started) -> tuple[Any, Any, Any]:
    services = bootstrap(_config(started.settings, started.server.url))
    engine = services.rollout_engine()
    return services, engine, services.refit_service(engine=engine, trainer=started.trainer)


def _served(engine: Any, ids: torch.Tensor) -> torch.Tensor:
    return engine.log_probs(ids)[0]


@pytest.mark.slow
@pytest.mark.xdist_group("attached-bf16-server")
def test_a_users_bf16_server_refits_while_a_client_streams(bf16: Started, cold_cache: Path, tmp_path: Path) -> None:
    """Three refits while an OpenAI client streams completions, each equal to a cold start; then a
    refit refused after finalize and a trainer killed mid-refit both leave the server on its
    previous weights and serving; then vLLM's own weight-sync client refits it."""
    from adapters.vllm.controls import HttpControl

    services, engine, svc = _attach(bf16)
    trainer = bf16.trainer
    comparer = ColdStartComparer(with_cold_host(services), trainer.config.vocab_size, bf16.settings, tmp_path, cold_cache)
    control = HttpControl(bf16.server.url)
    assert comparer.refuses(engine) is False  # started from a checkpoint: it serves before any refit
    client = StreamingClient(bf16.server.url, control.served_model(), [3, 14, 15, 92, 65, 35]).start()
    try:
        for step in (1, 2, 3):
            trainer.perturb_(step, 0.02)
            client.go()
            chunks = client.chunks
            deadline = time.monotonic() + 300
            while client.chunks == chunks and time.monotonic() < deadline:  # a stream is in flight
                time.sleep(0.01)
            report = svc.refit()
            client.hold()
            record = comparer.compare(engine, trainer, report, step)
            assert record.equals_cold_start, record
            assert control.weight_version() == f"rl-refit-{step}"
            assert not control.is_paused()
        assert client.failures == [], client.failures
        assert client.completed >= 3

        # a refit refused after finalize (the workers' audit finds a parameter it did not write):
        # the previous weights come back, bit for bit, and the server serves them
        before = _served(engine, comparer.ids)
        trainer.perturb_(4, 0.02)
        dropped = "model.layers.0.mlp.down_proj.weight"
        partial = _Without(trainer, dropped)
        with pytest.raises(RefitFailed) as info:
            services.refit_service(engine=engine, trainer=partial).refit()
        assert isinstance(info.value.__cause__, RefitIncomplete) or "RefitIncomplete" in str(info.value)
        assert info.value.report.outcome is RefitOutcome.ROLLED_BACK, info.value.report
        assert not control.is_paused() and not engine.is_stale
        assert torch.equal(_served(engine, comparer.ids), before)

        # the trainer killed in the middle of a refit: within the ceiling, the previous weights again
        engine.close()  # this trainer lets go (the server keeps running)
        assert bf16.server.healthy()
        _kill_a_trainer_mid_refit(bf16, tmp_path)
        deadline = time.monotonic() + RECOVERY_CEILING_S
        while control.is_paused() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not control.is_paused(), "the server stayed paused after its trainer died"
        assert torch.equal(control.log_probs(comparer.ids), before)

        # vLLM's own client and trainer factory, selecting rl-refit by name
        trainer.perturb_(5, 0.02)
        _refit_with_engine_argss_client(bf16.server.url, trainer)
        ref = comparer.reference(trainer)
        assert torch.equal(control.log_probs(comparer.ids), ref.log_probs)
        assert control.greedy(comparer.prompts, bf16.settings.new_tokens) == ref.tokens
        assert control.weight_version() == "rl-refit-1"  # the factory's sender counts its own rounds
        client.go()
        time.sleep(1.0)
        client.hold()
        assert client.failures == [], client.failures
    finally:
        client.stop()
        engine.close()
    assert bf16.server.healthy()  # closing never stops the user's server


@attrs.define
class _Without:
    """A trainer whose stream lacks one tensor."""

    trainer: Any
    name: str

    def __getattr__(self, item: str) -> Any:
        return getattr(self.trainer, item)

    def named_weights(self) -> Any:
        return ((n, t) for n, t in self.trainer.named_weights() if n != self.name)


TRAINER_SCRIPT = r"""
import sys, time, json
from app.bootstrap import bootstrap
from app.services.demo_config import engine_config
from app.services.engine_demo import EngineDemoSettings
from domain.quant.plan import QuantizationPlan
settings = EngineDemoSettings(deployment="attached", plan=QuantizationPlan.from_presets(None, None),
                              model="micro-dense", url=sys.argv[1])
def progress(done, total):
    print("MID-REFIT", flush=True)
    time.sleep(3600)  # killed here, between two buckets
services = bootstrap(engine_config(settings, 0.25), progress=progress)
trainer = services.trainer_model()
trainer.perturb_(99, 0.05)
services.refit_service(trainer=trainer).refit()
"""


def _kill_a_trainer_mid_refit(started: Started, tmp_path: Path) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(script), started.server.url], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env, cwd=str(ROOT))
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:  # the trainer's log lines come first
            seen.append(line)
            if b"MID-REFIT" in line or len(seen) > 200:
                break
        assert seen and b"MID-REFIT" in seen[-1], seen
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)


def _refit_with_engine_argss_client(url: str, trainer: Any) -> None:
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        WeightSource,
        WeightTransferTrainerFactory,
    )

    from adapters.vllm.transfer_trainer import RlRefitTrainerInitInfo

    class Source(WeightSource):
        def metadata(self) -> Any:
            return []

        def __iter__(self) -> Any:
            return iter(trainer.named_weights())

    client = HTTPVLLMWeightSyncClient(url)
    sender = WeightTransferTrainerFactory.trainer_init(RlRefitTrainerInitInfo(rank=0, workers=1, bucket_bytes=1 << 18),
                                                      client=client, source=Source())
    try:
        import requests

        requests.post(f"{url}/pause", params={"mode": "keep"}, timeout=60).raise_for_status()
        sender.send_weights()
        requests.post(f"{url}/reset_prefix_cache", timeout=60)
        requests.post(f"{url}/resume", timeout=60).raise_for_status()
    finally:
        sender.shutdown()


@pytest.mark.slow
@pytest.mark.heavy  # the BF16 server's test covers the path; this one adds a quantized server
def test_a_users_fp8_block_server_refits_while_a_client_streams(tmp_path_factory: pytest.TempPathFactory,
                                                                cold_cache: Path, tmp_path: Path) -> None:
    with _start(tmp_path_factory, "FP8_BLOCK") as started:
        services, engine, svc = _attach(started)
        comparer = ColdStartComparer(with_cold_host(services), started.trainer.config.vocab_size, started.settings,
                                     tmp_path, cold_cache)
        from adapters.vllm.controls import HttpControl

        client = StreamingClient(started.server.url, HttpControl(started.server.url).served_model(),
                                 [2, 7, 18, 28, 18, 28]).start()
        try:
            for step in (1, 2):
                started.trainer.perturb_(step, 0.02)
                client.go()
                report = svc.refit()
                client.hold()
                record = comparer.compare(engine, started.trainer, report, step)
                assert record.equals_cold_start, record
            assert client.failures == [], client.failures
        finally:
            client.stop()
            engine.close()


@pytest.mark.slow
def test_a_server_killed_mid_refit_gives_the_trainer_one_typed_error_and_leaves_no_ring(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    from domain.errors import RefitError

    rings = _shm_rings()
    with _start(tmp_path_factory, None) as started:
        services = bootstrap(_config(started.settings, started.server.url),
                             progress=lambda done, total: started.server.kill())
        engine = services.rollout_engine()
        t0 = time.monotonic()
        with pytest.raises(RefitError) as info:
            services.refit_service(engine=engine, trainer=started.trainer).refit()
        assert time.monotonic() - t0 < RECOVERY_CEILING_S, "the trainer learned of the dead server too late"
        assert "\n" not in str(info.value).strip()
        engine.close()
    assert _shm_rings() <= rings  # nothing of this refit's ring is left


ASYNC_SCRIPT = r"""
import asyncio, json, sys, threading
from pathlib import Path
import attrs
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.engine.async_llm import AsyncLLM
from adapters.vllm.attached import Expected, attach
from adapters.vllm.controls import AsyncLlmControl
from app.bootstrap import bootstrap
from app.services.demo_config import engine_config, with_engine_args
from app.services.engine_demo import ColdStartComparer, EngineDemoSettings
from domain.quant.plan import QuantizationPlan
from tests.vllm.cold_host import with_cold_host

ENGINE_ARGS = dict(skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=128, seed=0,
                   worker_extension_cls="adapters.vllm.extension.RefitWorkerExtension",
                   weight_transfer_config={"backend": "rl_refit"})

def control_of(kind, model):
    if kind == "ray":  # an AsyncLLM held in a Ray actor, its methods exposed (verl's and NeMo-RL's shape)
        import ray
        from adapters.vllm.controls import RayControl
        # Ray runs its workers at niceness 15: on a busy machine the actor's vLLM (imports, engine
        # core, worker) would get a sliver of the CPU. At 0 it starts as every other engine here.
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config={"worker_niceness": 0})

        @ray.remote
        class VllmActor:
            def __init__(self, model):
                self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **ENGINE_ARGS))

            async def collective_rpc(self, method, args=()):
                return await self.llm.collective_rpc(method, args=args)

            async def init_weight_transfer_engine(self, request):
                return await self.llm.init_weight_transfer_engine(request)

            async def start_weight_update(self):
                return await self.llm.start_weight_update()

            async def update_weights(self, request):
                return await self.llm.update_weights(request)

            async def finish_weight_update(self):
                return await self.llm.finish_weight_update()

            async def pause_generation(self, mode="keep"):
                return await self.llm.pause_generation(mode=mode)

            async def resume_generation(self):
                return await self.llm.resume_generation()

            async def reset_prefix_cache(self, reset_running_requests=False):
                return await self.llm.reset_prefix_cache(reset_running_requests)

            async def update_weight_version(self, version):
                return await self.llm.update_weight_version(version)

            async def get_weight_version(self):
                return await self.llm.get_weight_version()

            async def generate(self, prompt, params, request_id, lora_request=None):
                async for out in self.llm.generate(prompt, params, request_id=request_id, lora_request=lora_request):
                    yield out

        actor = VllmActor.remote(model)
        return RayControl(actor, same_host=True), ray.shutdown
    if kind == "llm":  # an offline LLM (its engine core in a process of its own, vLLM's default)
        from vllm import LLM
        from adapters.vllm.controls import LlmControl
        llm = LLM(model=model, **ENGINE_ARGS)
        return LlmControl(llm), lambda: llm.llm_engine.engine_core.shutdown()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    args = AsyncEngineArgs(model=model, **ENGINE_ARGS)
    async def make():
        return AsyncLLM.from_engine_args(args)
    llm = asyncio.run_coroutine_threadsafe(make(), loop).result()
    return AsyncLlmControl(llm, loop), llm.shutdown

def main():
    model, cache, work, kind = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    control, shutdown = control_of(kind, model)
    settings = EngineDemoSettings(deployment="attached", plan=QuantizationPlan.from_presets(None, None), model="micro-dense")
    services = bootstrap(with_engine_args(engine_config(settings, 0.25), start_timeout_s=900))
    trainer = services.trainer_model()
    engine = attach(control, Expected(), bucket_bytes=services.bucket_bytes, settings={})
    svc = services.refit_service(engine=engine, trainer=trainer)
    comparer = ColdStartComparer(with_cold_host(services), trainer.config.vocab_size, settings, work, cache)
    trainer.perturb_(1, 0.02)
    record = comparer.compare(engine, trainer, svc.refit(), 1)
    version = control.weight_version()
    engine.close()
    shutdown()
    print("RESULT " + json.dumps({"equals_cold_start": record.equals_cold_start, "record": str(record),
                                  "version": version}), flush=True)


if __name__ == "__main__":  # vLLM starts its engine core with spawn
    main()
"""


@pytest.mark.slow
# the offline `LLM` is every colocated test's control, so make test leaves its cell to make bench
@pytest.mark.parametrize("kind", ["async", pytest.param("llm", marks=pytest.mark.heavy), "ray"])
def test_an_engine_object_the_caller_holds_refits_equal_to_a_cold_start(tmp_path_factory: pytest.TempPathFactory,
                                                                        cold_cache: Path, tmp_path: Path,
                                                                        kind: str) -> None:
    """An `AsyncLLM` (verl's and NeMo-RL's shape), an offline `LLM`, or an AsyncLLM in a Ray actor the
    caller built with rl-refit's backend, refitted through its own methods (AsyncLlmControl,
    LlmControl, RayControl)."""
    if kind == "ray":
        pytest.importorskip("ray", reason="Ray is an optional extra (rl-refit[ray]); scripts/setup-vllm-env.sh installs it")
    _, _, start = _export(tmp_path_factory, None)
    script = tmp_path / "engine_object.py"
    script.write_text(ASYNC_SCRIPT)
    env = {**server_environment()}
    out = subprocess.run([sys.executable, str(script), str(start), str(cold_cache), str(tmp_path), kind],
                         capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=1500)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, out.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["equals_cold_start"], result["record"]
    assert result["version"] == "rl-refit-1"  # the refit's weight version, set through the engine object


@pytest.mark.slow
@pytest.mark.xdist_group("attached-bf16-server")
def test_the_main_job_attaches_to_a_users_server(bf16: Started) -> None:
    out = subprocess.run([sys.executable, "-m", "app.cli.main", "demo", "vllm", "--attach",
                          bf16.server.url, "--model", bf16.model, "--linear", "BF16", "--moe", "BF16", "--steps", "1",
                          "--json"], capture_output=True, text=True, cwd=str(ROOT), timeout=1500,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    payload = json.loads(out.stdout)
    assert payload["deployment"] == "attached"
    assert payload["steps"] and all(step["equals_cold_start"] for step in payload["steps"]), payload
