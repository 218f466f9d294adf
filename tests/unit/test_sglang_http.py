"""The attached SGLang deployment: SglangRolloutEngine over HttpClient, against the in-process fake
engine behind SGLang 0.5.23's HTTP routes on loopback (tests/engine_fakes/sglang_server.py), whose
tensor payloads are read back through the port of SGLang's own deserializer."""

from __future__ import annotations

import pickle
import subprocess
import sys
from collections.abc import Iterator

import pytest
import structlog
import torch

from adapters.sglang import loader as refit_loader
from adapters.sglang.engine import SglangRolloutEngine
from adapters.sglang.http_client import AttachedSglangEngine, HttpClient, attach
from adapters.sglang.serializer import deserialize, serialize
from app.services.refit import RefitService
from domain.errors import EngineUpdateFailed, RefitFailed, ServerMismatch, ServerUnreachable
from domain.quant.stream import quantize_stream
from domain.refit.buckets import pack_buckets
from domain.refit.report import RefitOutcome
from tests.engine_fakes.sglang import (
    UNSENT,
    FakeSglangEngine,
    FakeSglangModel,
    FakeTrainer,
    plan_for,
    trainer_weights,
)
from tests.engine_fakes.sglang_server import FakeSglangServer

BUCKET = 12_000  # several buckets per layer: scales and experts straddle buckets
# (linear, moe, native MXFP8): BF16, MXFP8 with its scales staged, MXFP4 experts staged per layer
PLANS = [(None, None, False), ("MXFP8", None, True), (None, "MXFP4", False)]


@pytest.fixture
def served() -> Iterator[tuple[FakeSglangModel, FakeSglangServer]]:
    model = FakeSglangModel(linear="MXFP8")
    with FakeSglangServer(FakeSglangEngine(model)) as server:
        yield model, server


def snapshot(model: FakeSglangModel) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in (dict(model.named_parameters()) | dict(model.named_buffers())).items()}


def sent(model: FakeSglangModel) -> dict[str, torch.Tensor]:
    """What a refit writes (the two models' rotary caches and vision towers are random apart)."""
    return {n: t for n, t in snapshot(model).items() if not n.startswith(UNSENT)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


def refit(engine: SglangRolloutEngine, seed: int, refit_id: int) -> None:
    engine.begin_refit(refit_id)
    for bucket in pack_buckets(list(quantize_stream(engine.plan, trainer_weights(seed))), BUCKET, reuse_buffer=True):
        engine.load_bucket(bucket)
    engine.finalize_refit()


@pytest.mark.parametrize(("linear", "moe", "native"), PLANS)
def test_refits_over_http_equal_the_direct_path(linear: str | None, moe: str | None, native: bool) -> None:
    plan = plan_for(linear, moe, native)
    direct_model, served_model = FakeSglangModel(linear=linear, moe=moe), FakeSglangModel(linear=linear, moe=moe)
    direct = SglangRolloutEngine(FakeSglangEngine(direct_model), plan, native_mxfp8=native)
    with FakeSglangServer(FakeSglangEngine(served_model)) as server:
        engine = attach(server.url, plan, native_mxfp8=native)
        for refit_id, seed in enumerate((1, 2, 3), start=1):
            before = snapshot(served_model)
            refit(direct, seed, refit_id)
            refit(engine, seed, refit_id)
            assert same(sent(direct_model), sent(served_model)), f"refit {refit_id} differs from direct"
            assert not same(before, snapshot(served_model))
        assert server.paused is None and not server.dead and not server.engine.session


def test_every_refit_is_bracketed_by_pause_and_continue(served: tuple[FakeSglangModel, FakeSglangServer]) -> None:
    _, server = served
    engine = attach(server.url, plan_for("MXFP8", None, True), native_mxfp8=True)
    server.events.clear()
    refit(engine, 1, 1)
    first, *middle, end, flush, last = server.events
    assert (first, end, flush, last) == ("/pause_generation", "/end_weight_update", "/flush_cache",
                                         "/continue_generation")
    assert middle[0] == "/begin_weight_update" and set(middle[1:]) == {"/update_weights_from_tensor"}
    assert server.engine.flushes == 1 and server.paused is None


def test_a_failure_mid_stream_leaves_the_previous_weights_and_the_server_continued(
        served: tuple[FakeSglangModel, FakeSglangServer]) -> None:
    model, server = served
    plan = plan_for("MXFP8", None, True)
    engine = attach(server.url, plan, native_mxfp8=True)
    service = RefitService(FakeTrainer(seed=1), engine, plan, bucket_bytes=BUCKET)
    assert service.refit().ok
    live = snapshot(model)
    real_load, calls = model.load_weights, {"n": 0}

    def failing(weights):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected load failure")
        return real_load(weights)

    model.load_weights = failing  # type: ignore[method-assign]
    service.trainer = FakeTrainer(seed=2)
    with pytest.raises(RefitFailed, match="injected load failure") as info:
        service.refit()
    assert info.value.report.outcome is RefitOutcome.ROLLED_BACK  # type: ignore[attr-defined]
    assert same(live, snapshot(model)) and not engine.is_stale
    assert not server.dead and server.paused is None and not server.engine.session
    assert server.events[-1] == "/continue_generation"
    model.load_weights = real_load  # type: ignore[method-assign]
    assert service.refit().ok  # the next refit goes through


def test_a_restore_that_fails_leaves_the_server_paused_and_the_engine_stale(
        served: tuple[FakeSglangModel, FakeSglangServer], monkeypatch: pytest.MonkeyPatch) -> None:
    model, server = served
    engine = attach(server.url, plan_for("MXFP8", None, True), native_mxfp8=True)
    refit(engine, 1, 1)
    monkeypatch.setattr(model, "load_weights", lambda weights: (_ for _ in ()).throw(RuntimeError("injected")))
    monkeypatch.setattr(refit_loader.RefitLoader, "abort",
                        lambda self, reason: (_ for _ in ()).throw(OSError("backup unreadable")))
    with pytest.raises(EngineUpdateFailed, match="could not restore"):
        refit(engine, 2, 2)
    assert engine.is_stale and server.paused == "retract" and not server.dead


def test_flush_cache_is_retried_while_requests_are_in_flight(served: tuple[FakeSglangModel, FakeSglangServer]) -> None:
    _, server = served
    engine = attach(server.url, plan_for("MXFP8", None, True), native_mxfp8=True)
    server.busy_flushes = 3
    refit(engine, 1, 1)
    assert server.events.count("/flush_cache") == 4 and server.engine.flushes == 1


def test_flush_cache_retries_are_bounded(served: tuple[FakeSglangModel, FakeSglangServer]) -> None:
    _, server = served
    engine = attach(server.url, plan_for("MXFP8", None, True), native_mxfp8=True)
    engine.client.flush_tries = 3  # type: ignore[attr-defined]
    server.busy_flushes = 100
    with structlog.testing.capture_logs() as logs:
        refit(engine, 1, 1)
    assert server.events.count("/flush_cache") == 3 and server.engine.flushes == 0
    assert server.paused is None  # the refit itself went live; only the old cache stayed
    assert any("kept its radix cache" in e["event"] for e in logs)


def test_one_payload_per_tensor_parallel_rank() -> None:
    with FakeSglangServer(FakeSglangEngine(FakeSglangModel(linear=None)), tp_size=2) as server:
        engine = attach(server.url, plan_for(None, None))
        refit(engine, 1, 1)
        assert server.payloads and set(server.payloads) == {2}


def test_an_unreachable_url_is_one_typed_line() -> None:
    with FakeSglangServer(FakeSglangEngine(FakeSglangModel())) as server:
        url = server.url
    with pytest.raises(ServerUnreachable, match=r"SGLang server at .* did not answer GET /server_info.*"
                                                 r"rollout\.engine_kwargs\.sglang\.url"):
        attach(url, plan_for(None, None))


def test_a_server_without_rl_refits_loader_is_refused() -> None:
    refused = pytest.raises(ServerMismatch, match=r"without rl-refit's weight loader.*--custom-weight-loader "
                                                  r"adapters\.sglang\.loader\.load")
    with FakeSglangServer(FakeSglangEngine(FakeSglangModel(), custom_weight_loaders=())) as server, refused:
        attach(server.url, plan_for(None, None))


def test_a_server_without_the_routes_is_refused_before_anything_is_written() -> None:
    model = FakeSglangModel()
    with FakeSglangServer(FakeSglangEngine(model), routes=False) as server:
        engine = attach(server.url, plan_for("MXFP8", None, True), native_mxfp8=True)
        before = snapshot(model)
        with pytest.raises(ServerMismatch, match="has no route /pause_generation"):
            refit(engine, 1, 1)
        assert same(before, snapshot(model))


def test_a_server_of_another_model_is_refused() -> None:
    refused = pytest.raises(ServerMismatch, match=r"serves '/ckpt/other', not '/ckpt/mine' \(model\.path\)")
    with FakeSglangServer(FakeSglangEngine(FakeSglangModel()), model_path="/ckpt/other") as server, refused:
        attach(server.url, plan_for(None, None), model="/ckpt/mine")


def test_a_loader_exception_stops_sglang_so_the_attached_loader_never_raises(
        served: tuple[FakeSglangModel, FakeSglangServer]) -> None:
    """What the fake mirrors: SGLang does not catch a custom loader's exception (its scheduler stops).
    A refit that raises there (the in-process engine's contract) takes the server down."""
    _, server = served
    client = HttpClient(server.url)
    client.begin_weight_update()
    with pytest.raises(ServerUnreachable, match="closed connection"):  # no BEGIN marker: the loader raises
        client.update_weights_from_tensor([("model.layers.0.self_attn.o_proj.weight", torch.zeros(1))],
                                          "adapters.sglang.loader.load", False)
    assert server.dead
    with pytest.raises(ServerUnreachable):
        client.flush_cache()


def test_close_lets_go_without_stopping_the_server(served: tuple[FakeSglangModel, FakeSglangServer]) -> None:
    _, server = served
    engine = attach(server.url, plan_for(None, None))
    status_dir = engine.client.status.directory  # type: ignore[attr-defined]
    engine.close()
    assert not server.dead and server.paused is None
    import os

    assert not os.path.exists(status_dir)


# --- the serializer port ---------------------------------------------------------------------------


def test_tensors_cross_to_another_process_through_shared_memory() -> None:
    named = [("a", torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)), ("b", torch.ones(5, dtype=torch.float8_e4m3fn)),
             ("c", torch.arange(10, dtype=torch.int32)[2:7]), ("d", torch.zeros(0))]
    expected = str([(n, str(t.dtype), list(t.shape), t.float().sum().item()) for n, t in named])
    payload = serialize(named)
    strategy = torch.multiprocessing.get_sharing_strategy()
    code = ("import sys, torch\nfrom adapters.sglang.serializer import deserialize\n"
            "got = deserialize(sys.stdin.read())\n"
            "print([(n, str(t.dtype), list(t.shape), t.float().sum().item()) for n, t in got])\n"
            "got[0][1].fill_(7)\n"
            "del got\n")  # a process that exits still mapping a segment leaves it in /dev/shm
    out = subprocess.run([sys.executable, "-c", code], input=payload, text=True, capture_output=True, timeout=120,
                         check=True).stdout
    assert out.strip() == expected
    assert torch.equal(named[0][1], torch.full((3, 4), 7, dtype=torch.bfloat16))  # the same memory, not a copy
    assert torch.multiprocessing.get_sharing_strategy() == strategy  # the process-wide strategy is untouched
    del named
    import gc
    import os

    gc.collect()
    assert [f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_")] == []


def test_the_ported_unpickler_refuses_what_sglangs_refuses() -> None:
    with pytest.raises(RuntimeError, match=r"Blocked unsafe global \(posix\.system\)"):
        deserialize(pickle.dumps(__import__("os").system))
    got = deserialize(serialize([("x", torch.ones(2))]))
    assert got[0][0] == "x" and torch.equal(got[0][1], torch.ones(2))


def test_the_attached_engine_has_the_in_process_engines_commit_mode() -> None:
    with FakeSglangServer(FakeSglangEngine(FakeSglangModel())) as server:
        engine = attach(server.url, plan_for(None, None))
        assert isinstance(engine, AttachedSglangEngine) and engine.commit_mode.value == "transactional"


# --- the configuration ---------------------------------------------------------------------------

SGLANG = ["rollout.name=sglang", "reference.model=micro-moe", "rollout.deployment=attached"]


def test_the_composition_root_attaches_to_the_configured_url() -> None:
    """Without sglang installed here: it runs in the server."""
    from app.bootstrap import bootstrap

    with FakeSglangServer(FakeSglangEngine(FakeSglangModel())) as server:
        services = bootstrap(overrides=[*SGLANG, f"rollout.engine_kwargs.sglang.url={server.url}",
                                        "rollout.engine_kwargs.sglang.pause_mode=in_place"])
        engine = services.rollout_engine()
        assert isinstance(engine, AttachedSglangEngine) and engine.client.url == server.url  # type: ignore[attr-defined]
        assert engine.client.pause_mode == "in_place" and engine.plan == services.plan  # type: ignore[attr-defined]
        assert server.events == ["/server_info"]  # probed; nothing paused, nothing written


def test_attached_without_a_url_names_the_key() -> None:
    from app.bootstrap import bootstrap
    from domain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"rollout\.engine_kwargs\.sglang\.url: .*give its URL"):
        bootstrap(overrides=SGLANG).rollout_engine()


def test_a_server_in_another_process_refits_equal_to_the_direct_path(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The tensors cross to the server's process as shared memory, and the loader's outcome comes
    back through the status file it writes there; nothing of the refits stays in /dev/shm."""
    import base64
    import io
    import json
    import os
    import urllib.request

    plan = plan_for("MXFP8", None, True)
    torch.manual_seed(0)
    direct_model = FakeSglangModel(linear="MXFP8")
    direct = SglangRolloutEngine(FakeSglangEngine(direct_model), plan, native_mxfp8=True)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-m", "tests.engine_fakes.sglang_server", "MXFP8", "none"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        engine = attach(url, plan, native_mxfp8=True)
        for refit_id in (1, 2):
            refit(direct, refit_id, refit_id)
            refit(engine, refit_id, refit_id)
        with urllib.request.urlopen(f"{url}/rl_refit_test/weights", timeout=60) as resp:
            raw = base64.b64decode(json.loads(resp.read())["weights"])
        served = torch.load(io.BytesIO(raw))
        assert same(served, {n: t.detach() for n, t in direct_model.state_dict().items()})
        leftovers = [f for f in os.listdir("/dev/shm") if f.startswith((f"torch_{os.getpid()}_", f"torch_{proc.pid}_"))]
        assert leftovers == []
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=60)


def test_the_in_process_engine_client_gets_a_failure_reported_not_raised_into_sglang() -> None:
    """sglang.Engine runs the loader in its scheduler process too, which an exception would stop:
    EngineClient reads the loader's status file as the HTTP client does."""
    from adapters.sglang.client import EngineClient

    model = FakeSglangModel(linear="MXFP8")
    fake = FakeSglangEngine(model)
    plan = plan_for("MXFP8", None, True)
    engine = SglangRolloutEngine(EngineClient(fake), plan, native_mxfp8=True)
    refit(engine, 1, 1)
    live = snapshot(model)
    real_load, calls = model.load_weights, {"n": 0}

    def failing(weights):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected load failure")
        return real_load(weights)

    model.load_weights = failing  # type: ignore[method-assign]
    with pytest.raises(EngineUpdateFailed, match=r"loader failed \(RuntimeError: injected load failure\); the engine "
                                                 r"restored"):
        refit(engine, 2, 2)  # the fake would have let an exception through: the loader did not raise
    assert same(live, snapshot(model)) and not engine.is_stale and not fake.session
    model.load_weights = real_load  # type: ignore[method-assign]
    refit(engine, 3, 3)
    assert not same(live, snapshot(model))


def test_a_server_started_for_another_quantization_is_refused_with_the_plans_flags() -> None:
    from app.bootstrap import bootstrap

    with FakeSglangServer(FakeSglangEngine(FakeSglangModel())) as server:  # started BF16
        services = bootstrap(overrides=[*SGLANG, f"rollout.engine_kwargs.sglang.url={server.url}",
                                        "rollout.quantization.linear=FP8_BLOCK", "rollout.quantization.moe=FP8_BLOCK"])
        with pytest.raises(ServerMismatch, match=r"started with quantization=None, but the plan needs "
                                                 r"'compressed-tensors': restart the server with the plan's flags "
                                                 r"\(--quantization compressed-tensors --json-model-override-args '\{"):
            services.rollout_engine()
        assert server.events == ["/server_info"]


def test_attached_sglang_refits_one_server() -> None:
    from app.bootstrap import bootstrap
    from domain.errors import ConfigError

    services = bootstrap(overrides=[*SGLANG, "rollout.engine_kwargs.sglang.url=http://127.0.0.1:9", "rollout.replicas=2"])
    with pytest.raises(ConfigError, match=r"rollout\.replicas: .*set rollout\.replicas=1"):
        services.rollout_engine()
