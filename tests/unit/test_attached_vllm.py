"""The attached vLLM engine end to end on fakes: AttachedWorkers -> a fake server's control plane ->
the rl_refit backend's WorkerSession in each fake worker, with the bucket stream through the real
shared-memory ring. What a real server adds (vLLM's routes, its workers) is in
tests/vllm/test_attached_server.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from adapters.vllm.attached import AttachedWorkers, Expected, attach, probe
from adapters.vllm.errors import SessionRefused
from adapters.vllm.session import InitInfo, UpdateInfo, rl_refit_version
from app.services.refit import RefitService
from domain.errors import EngineStale, RefitFailed, ServerMismatch, WireProtocolError
from domain.refit.report import RefitOutcome
from tests.engine_fakes.vllm import FakeTrainer, FakeVllmModel, fp8_plan
from tests.engine_fakes.vllm_server import FakeServer, weights_of


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _engine(server: FakeServer) -> Any:
    return attach(server, Expected(), bucket_bytes=1 << 20, settings={"timeout_s": 60.0})


def _service(engine: Any, seed: int = 0) -> RefitService:
    return RefitService(FakeTrainer(seed), engine, fp8_plan(), bucket_bytes=1 << 20)


def _failed(svc: RefitService) -> Any:
    """The report of a refit that fails (RefitFailed carries it)."""
    with pytest.raises(RefitFailed) as info:
        svc.refit()
    return info.value.report


def test_a_refit_is_bracketed_by_a_pause_and_a_resume_and_sets_the_weight_version() -> None:
    server = FakeServer([FakeVllmModel()])
    engine = _engine(server)
    try:
        report = _service(engine).refit()
        assert report.ok, report.error
        assert server.calls[0] == "rl_refit_info"  # the probe, before anything else
        steps = [c for c in server.calls if not c.startswith("rl_refit_")]
        assert steps == ["pause:keep", "init", "start", "update", "finish", "reset_prefix_cache", "resume"]
        assert not server.paused and server.version == "rl-refit-1"
        report = _service(engine, seed=1).refit()
        assert report.ok and server.version == "rl-refit-2"
        assert server.calls.count("init") == 1  # the transport is joined once
    finally:
        engine.close()
    assert "close" in server.calls and not server.paused


def test_a_refit_that_fails_mid_stream_restores_the_previous_refit_and_resumes() -> None:
    model = FakeVllmModel()
    server = FakeServer([model])
    engine = _engine(server)
    try:
        assert _service(engine, seed=0).refit().ok
        live = weights_of(model)
        model.fail_at_call = model.load_calls  # the next refit's bucket
        report = _failed(_service(engine, seed=1))
        assert report.outcome is RefitOutcome.ROLLED_BACK
        assert "injected failure" in (report.error or "")
        assert _equal(weights_of(model), live)  # the previous refit's weights, bit for bit
        assert not server.paused and not engine.is_stale
        assert server.sessions()[0].restores == 1
        model.fail_at_call = None
        assert _service(engine, seed=2).refit().ok  # and the next refit goes live
    finally:
        engine.close()


def test_a_first_refit_that_fails_reloads_the_servers_own_checkpoint() -> None:
    model = FakeVllmModel()
    server = FakeServer([model])
    started = weights_of(model)
    engine = _engine(server)
    try:
        model.fail_at_call = model.load_calls
        assert _failed(_service(engine)).outcome is RefitOutcome.ROLLED_BACK
        assert server.disk_loads == 1 and _equal(weights_of(model), started)
        assert not server.paused
    finally:
        engine.close()


def test_a_failed_refit_with_nothing_to_restore_from_leaves_the_server_paused_and_stale() -> None:
    model = FakeVllmModel()
    server = FakeServer([model], from_disk=False)  # started with load_format=dummy
    engine = _engine(server)
    try:
        model.fail_at_call = model.load_calls
        report = _failed(_service(engine))
        assert report.outcome is RefitOutcome.STALE
        assert server.paused  # it would serve incomplete weights
        with pytest.raises(EngineStale, match=r"load_format=dummy.*stays paused"):
            engine.log_probs(torch.zeros(1, 4, dtype=torch.long))
        with pytest.raises(EngineStale):  # and the workers themselves refuse
            server.log_probs(torch.zeros(1, 4, dtype=torch.long))
    finally:
        engine.close()


def test_a_committed_refit_the_trainer_refuses_is_undone_from_the_workers_backup() -> None:
    from app.services.verification import PostRefitProbe

    model = FakeVllmModel()
    server = FakeServer([model])
    engine = _engine(server)

    class Refuses:  # the probe finds the engine too far from the trainer
        def measure(self, engine: Any, plan: Any) -> Any:
            from domain.errors import ProbeMismatch

            raise ProbeMismatch(2, 9.0, 0.0, "the trainer")

    try:
        assert _service(engine).refit().ok
        live = weights_of(model)
        svc = _service(engine, seed=1)
        svc = RefitService(svc.trainer, engine, svc.plan, bucket_bytes=1 << 20, probe=Refuses())  # type: ignore[arg-type]
        report = _failed(svc)
        assert report.outcome is RefitOutcome.ROLLED_BACK and report.engine_state == "restored", report
        assert _equal(weights_of(model), live) and not engine.is_stale and not server.paused
    finally:
        engine.close()
    assert PostRefitProbe  # the real probe is what refuses in production


def test_only_the_session_token_drives_a_workers_refit() -> None:
    server = FakeServer([FakeVllmModel()])
    engine = _engine(server)
    try:
        assert _service(engine).refit().ok
        session = server.sessions()[0]
        with pytest.raises(SessionRefused, match="session token"):
            session.restore("0" * 32, "a stranger")
        with pytest.raises(SessionRefused):
            session.update(UpdateInfo("f" * 32, 9))
        # an idle session is taken over by a new trainer (the old one is gone)
        other = AttachedWorkers(server, 1 << 20, timeout_s=60.0)
        from adapters.vllm.engine import VllmRolloutEngine

        second = VllmRolloutEngine(other, restores=True)
        assert _service(second, seed=3).refit().ok
        with pytest.raises(SessionRefused):
            session.commit(engine.workers.token)  # the first trainer's token no longer drives it
        second.close()
    finally:
        engine.close()


def test_a_worker_call_that_changes_a_servers_model_needs_the_session_token() -> None:
    """Dev mode opens `/collective_rpc` to whoever reaches the port: every request that changes a
    worker (protocol.Access WRITE or SESSION: a begin, an abort, an adapter, the delta receiver, a
    restore, a commit...) without the trainer's token is refused, and the server keeps serving."""
    from adapters.vllm import protocol as p
    from tests.unit.test_vllm_protocol import SAMPLES

    server = FakeServer([FakeVllmModel()])
    engine = _engine(server)
    try:
        assert _service(engine).refit().ok
        before = weights_of(server.models[0])
        changing = [r for r in SAMPLES if type(r) in p.WORKER_REQUESTS and r.ACCESS is not p.Access.READ]
        assert {type(r) for r in changing} >= {k for k in p.WORKER_REQUESTS if k.ACCESS is not p.Access.READ} - {p.Load}
        for request in changing:
            (answer,) = server.collective_rpc(request.METHOD, request.to_plain())  # no token
            assert p.ErrorReply.from_plain(answer).type == "SessionRefused", (request, answer)
        (answer,) = server.collective_rpc(p.Abort.METHOD, p.with_token(p.Abort(), "0" * 32))  # another token
        assert p.ErrorReply.from_plain(answer).type == "SessionRefused"
        assert _equal(weights_of(server.models[0]), before)
        assert engine.workers.call(p.Digests()).digests  # a read needs no token
        assert _service(engine, seed=2).refit().ok  # the trainer's own calls carry it
    finally:
        engine.close()


def test_a_session_is_refused_while_another_trainers_refit_is_loading() -> None:
    server = FakeServer([FakeVllmModel()])
    session = server.sessions()[0]
    session.token = "a" * 32
    session.start()
    with pytest.raises(SessionRefused, match="in progress"):
        session.init(InitInfo("b" * 32, rl_refit_version(), "shm", {}, 1 << 20))


def test_a_trainer_of_another_rl_refit_version_is_refused_at_init() -> None:
    server = FakeServer([FakeVllmModel()])
    with pytest.raises(WireProtocolError, match="same rl-refit version"):
        server.sessions()[0].init(InitInfo("a" * 32, "0.0.0-other", "shm", {}, 1 << 20))


@pytest.mark.parametrize(("server_kwargs", "expected", "match"), [
    ({"version": "9.9.9"}, Expected(), "runs rl-refit 9.9.9"),
    ({}, Expected(model="/models/other"), "serves '/models/fake', not '/models/other'"),
    ({}, Expected(quantization="compressed-tensors", server_flags="--quantization compressed-tensors"),
     "--quantization compressed-tensors"),
])
def test_the_probe_refuses_a_server_that_differs_in_one_line(server_kwargs: dict[str, Any], expected: Expected,
                                                            match: str) -> None:
    server = FakeServer([FakeVllmModel()], **server_kwargs)
    with pytest.raises(ServerMismatch, match=match) as info:
        probe(server, expected)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("served", "planned", "same"), [
    (None, None, True), ("compressed-tensors", "compressed-tensors", True), ("modelopt_fp4", "modelopt", True),
    ("compressed-tensors", None, False), (None, "modelopt", False), ("modelopt", "modelopt_fp4", False),
    ("fp8", "compressed-tensors", False),
])
def test_the_servers_method_is_the_plans_or_what_vllm_resolved_it_to(served: str | None, planned: str | None,
                                                                     same: bool) -> None:
    from adapters.vllm.attached import same_method

    assert same_method(served, planned) is same


def _served_config(linear: str) -> dict[str, Any]:
    """The quantization_config a vLLM engine is sent for a plan (what `refit export` writes too)."""
    from app.bootstrap import bootstrap

    services = bootstrap(overrides=["rollout.name=vllm", "reference.model=micro-dense",
                                    f"rollout.quantization.linear={linear}"])
    config = services.engine_start("vllm").quantization_config
    assert config is not None
    return dict(config)


def test_the_probe_refuses_a_server_that_quantizes_otherwise_with_the_same_method() -> None:
    """An FP8_BLOCK server and an MXFP8 plan are both `compressed-tensors`: the scheme tells them apart."""
    from adapters.engine_overrides import quantization_scheme

    served, planned = _served_config("FP8_BLOCK"), _served_config("MXFP8")
    server = FakeServer([FakeVllmModel()], quantization="compressed-tensors", quantization_config=served)
    with pytest.raises(ServerMismatch, match=r"quantizes otherwise than the plan: it serves \[.*block.*\], the plan "
                                             r"needs \[.*num_bits=8 strategy=group group_size=32.*\]") as info:
        probe(server, Expected(quantization="compressed-tensors", scheme=quantization_scheme(planned)))
    assert "\n" not in str(info.value)
    probe(server, Expected(quantization="compressed-tensors", scheme=quantization_scheme(served)))  # the same: served


def test_fields_that_do_not_change_what_is_served_do_not_count() -> None:
    from adapters.engine_overrides import quantization_scheme

    config = _served_config("FP8_BLOCK")
    written = {**config, "quantization_status": "compressed", "global_compression_ratio": 1.5, "version": "0.17.0",
               "config_groups": {k: {**g, "weights": {**g["weights"], "observer": "minmax", "observer_kwargs": {}}}
                                 for k, g in config["config_groups"].items()}}
    assert quantization_scheme(written) == quantization_scheme(config)
    assert quantization_scheme({**config, "ignore": [*config["ignore"], "model.layers.0.mlp.down_proj"]}) \
        != quantization_scheme(config)  # one more layer left in BF16 is served otherwise
    assert quantization_scheme(None) is None


def test_the_probe_refuses_a_server_whose_kv_cache_dtype_differs() -> None:
    server = FakeServer([FakeVllmModel()], kv_cache_dtype="auto")
    with pytest.raises(ServerMismatch, match=r"KV cache in auto.*kv_cache_dtype is fp8.*--kv-cache-dtype fp8"):
        probe(server, Expected(kv_cache_dtype="fp8"))
    probe(FakeServer([FakeVllmModel()], kv_cache_dtype="fp8_e4m3"), Expected(kv_cache_dtype="fp8"))  # vLLM's fp8


def test_the_probe_refuses_a_server_without_the_backend() -> None:
    server = FakeServer([FakeVllmModel()])
    for w in server.workers:
        w.weight_transfer_engine = None
    with pytest.raises(ServerMismatch, match="--weight-transfer-config"):
        probe(server, Expected())


def test_two_workers_receive_one_ring_and_both_restore() -> None:
    models = [FakeVllmModel(), FakeVllmModel()]
    server = FakeServer(models)
    engine = _engine(server)
    try:
        assert _service(engine).refit().ok
        assert _equal(weights_of(models[0]), weights_of(models[1]))
        live = weights_of(models[0])
        models[1].fail_at_call = models[1].load_calls
        assert _failed(_service(engine, seed=1)).outcome is RefitOutcome.ROLLED_BACK
        assert _equal(weights_of(models[0]), live) and _equal(weights_of(models[1]), live)
        assert not server.paused
    finally:
        engine.close()


@pytest.mark.distributed
def test_a_side_group_carries_the_buckets_when_the_ring_cannot() -> None:
    """transport=gloo: the workers wait in init until the trainer joins (init runs in a thread)."""
    model = FakeVllmModel()
    server = FakeServer([model])
    engine = attach(server, Expected(), bucket_bytes=1 << 20, settings={"timeout_s": 60.0, "transport": "gloo"})
    try:
        assert _service(engine).refit().ok
        live = weights_of(model)
        model.fail_at_call = model.load_calls
        assert _failed(_service(engine, seed=1)).outcome is RefitOutcome.ROLLED_BACK
        assert _equal(weights_of(model), live)
        model.fail_at_call = None
        assert _service(engine, seed=2).refit().ok
    finally:
        engine.close()


def test_a_transport_that_cannot_reach_the_workers_is_refused_naming_the_key() -> None:
    from domain.errors import ConfigError

    server = FakeServer([FakeVllmModel()])
    engine = attach(server, Expected(), bucket_bytes=1 << 20, settings={"transport": "cuda_ipc"})
    try:
        with pytest.raises(RefitFailed) as info:
            _service(engine).refit()
        assert isinstance(info.value.__cause__, ConfigError)
        assert "rollout.engine_kwargs.vllm.transport" in str(info.value)
        assert not server.paused  # refused before anything was touched; the server serves on
    finally:
        engine.close()


def test_a_closed_engine_answers_closed_and_the_server_keeps_serving() -> None:
    from domain.errors import EngineClosed

    server = FakeServer([FakeVllmModel()])
    engine = _engine(server)
    assert _service(engine).refit().ok
    engine.close()
    engine.close()  # idempotent
    with pytest.raises(EngineClosed):
        engine.log_probs(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(RefitFailed) as info:
        _service(engine, seed=1).refit()
    assert isinstance(info.value.__cause__, EngineClosed)
    assert "close" in server.calls and not server.paused
    assert server.log_probs(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 3)  # the server was let go, not stopped
