"""The vLLM worker protocol (adapters.vllm.protocol): every request and reply record crosses
plain values, vLLM's msgpack and a server's JSON unchanged; every error class that may
cross is rebuilt on the trainer's side as itself; anything else is refused or named. Then the
extension end to end through ExtensionWorkers over fake vLLM workers."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from adapters.vllm import protocol as p
from adapters.vllm.errors import WorkerError
from app.services.refit import RefitService
from domain import errors
from domain.refit.storage import StorageFingerprint
from tests.engine_fakes.vllm import FakeTrainer, extension_engine, fp8_plan, msgpack_like

SAMPLES: list[p.Record] = [
    p.Begin(), p.Done(),
    p.Finalize(True), p.FinalizeReply(2, 0.25, 30, 28, ("a.weight", "b.weight"), 1), p.FinalizeReply(0, 0.0, 3),
    p.Abort(),
    p.Loaded(12),
    p.DeltaBaseQuery(), p.DeltaBaseReply("ab12", 1 << 20, 0.25), p.DeltaBaseReply(None, 0, 0.0),
    p.Fingerprint(), p.FingerprintReply([["a", 140000, [2, 3], [3, 1], "bfloat16"]]),
    p.Digests(), p.DigestsReply({"a": "00ff", "b": "ee11"}),
    p.LiveWeights(), p.LiveWeightsReply.of({"a": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
                                            "e": torch.empty(0, dtype=torch.float8_e4m3fn)}),
    p.KvScales(), p.KvScalesReply({"layers.0.self_attn.attn": [1.0, 1.0, 0.5, 1.0]}),
    p.BenchMode("load_weights"), p.BenchReload("/tmp/ckpt"), p.Seconds(0.5),
    p.ErrorReply("ValueError", "bad", {"key": "x", "peers": [1, 2]}),
    p.LoraStage(3, {"r": 8, "lora_alpha": 16.0, "target_modules": ["q_proj"], "modules_to_save": None},
                b"\x00\x01safetensors"), p.LoraStaged(14), p.LoraDrop(2),
    p.Info(), p.InfoReply("0.1.0", True, 0, 1, "/ckpt", None), p.InfoReply("0.1.0", False, 1, 2, "m", "fp8", "dummy"),
    p.Report(), p.ReportReply(p.FinalizeReply(0, 0.1, 3).to_plain(), None, None, 0, "finalized"),
    p.ReportReply(None, p.ErrorReply("PeerLost", "gone").to_plain(), "stale: no backup", 1, "idle"),
    p.Restore("the probe refused the refit"), p.Restored(True), p.Commit(),
]


def _json(value: Any) -> Any:
    """What a server's HTTP `/collective_rpc` does to a message: JSON text, bytes base64-encoded."""
    return p.from_json_safe(json.loads(json.dumps(p.json_safe(value))))


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("crossing", [lambda v: v, msgpack_like, _json], ids=["plain", "msgpack", "json"])
def test_every_record_crosses_unchanged(record: p.Record, crossing: Any) -> None:
    plain = record.to_plain()
    assert crossing(plain) == msgpack_like(plain)  # plain values only: what crosses is what was sent
    assert type(record).from_plain(crossing(plain)) == record


def test_every_rpc_has_a_sample() -> None:
    kinds = {type(r) for r in SAMPLES}
    assert set(p.REQUESTS) - {p.Load} <= kinds
    assert {r.REPLY for r in p.REQUESTS} <= kinds
    assert len({r.METHOD for r in p.REQUESTS}) == len(p.REQUESTS)
    assert all(r.METHOD.startswith("rl_refit_") for r in p.REQUESTS)


@pytest.mark.parametrize("served", ["worker", "bench"])
def test_every_rpc_method_is_derived_from_its_record_and_no_other_exists(served: str) -> None:
    """The request record is the one declaration of a worker call: the extension that serves it
    has the method vLLM calls by the record's METHOD (built by `serves`) and the record's handler;
    the class has no `rl_refit_*` method that is not a record's."""
    from adapters.vllm.bench_extension import BenchExtension
    from adapters.vllm.extension import RefitWorkerExtension

    cls, requests = ((RefitWorkerExtension, p.WORKER_REQUESTS) if served == "worker"
                     else (BenchExtension, p.REQUESTS))
    for kind in requests:
        method = getattr(cls, kind.METHOD)
        assert method.__name__ == kind.METHOD and kind.__name__ in (method.__doc__ or ""), kind
        assert callable(getattr(cls, kind.handler(), None)), f"{cls.__name__} has no {kind.handler()}"
    public = {name for name in dir(cls) if name.startswith("rl_refit_")}
    assert public == {kind.METHOD for kind in requests}


def test_a_derived_rpc_answers_its_handlers_reply_and_checks_access_before_the_handler() -> None:
    from adapters.vllm.extension import RefitWorkerExtension

    calls: list[str] = []

    class Worker(RefitWorkerExtension):
        def _rl_refit_session(self) -> Any:
            return None  # in-process: nothing to check for WRITE; SESSION needs a server's session

        def _rl_refit_on_kv_scales(self, request: p.KvScales) -> p.KvScalesReply:
            calls.append(type(request).__name__)
            return p.KvScalesReply({"attn": [1.0, 2.0, 3.0, 4.0]})

        def _rl_refit_on_commit(self, request: p.Commit) -> p.Record:
            calls.append("commit")
            return p.Done()

    worker = Worker()
    answer = worker.rl_refit_kv_scales(p.KvScales().to_plain())  # type: ignore[attr-defined]
    assert p.KvScalesReply.from_plain(answer).scales == {"attn": (1.0, 2.0, 3.0, 4.0)}
    refused = p.ErrorReply.from_plain(worker.rl_refit_commit(p.Commit().to_plain()))  # type: ignore[attr-defined]
    assert refused.type == "ServerMismatch" and "weight-transfer backend" in refused.message
    assert calls == ["KvScales"]  # the refused commit never reached its handler


def test_live_weights_come_back_bit_for_bit() -> None:
    tensors = {"w": torch.randn(4, 8).to(torch.bfloat16), "s": torch.rand(2).to(torch.float8_e4m3fn)}
    back = p.LiveWeightsReply.from_plain(_json(p.LiveWeightsReply.of(tensors).to_plain())).to_tensors()
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[n].view(torch.uint8), t.view(torch.uint8)) and back[n].dtype == t.dtype
               for n, t in tensors.items())


def test_a_fingerprint_comes_back_equal() -> None:
    fp = StorageFingerprint.of({"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)})
    assert p.FingerprintReply.from_plain(_json(p.FingerprintReply.of(fp).to_plain())).fingerprint() == fp


@pytest.mark.parametrize(("value", "match"), [
    (p.Done().to_plain(), r"expected a FinalizeReply record, got 'Done'"),
    ([2, 0.5, 30], r"expected a FinalizeReply record, got 'list'"),
    ({"record": "FinalizeReply", "kv_scales_reset": 1}, r"fields \['kv_scales_reset'\] instead of"),
    ({**p.FinalizeReply(1, 0.0, 1).to_plain(), "extra": 1}, r"fields .*'extra'.* instead of"),
    ({**p.FinalizeReply(1, 0.0, 1).to_plain(), "seconds": "soon"}, r"a malformed FinalizeReply record"),
])
def test_anything_but_the_record_is_refused_naming_it(value: Any, match: str) -> None:
    with pytest.raises(errors.WireProtocolError, match=match):
        p.FinalizeReply.from_plain(value)


# --- errors ----------------------------------------------------------------------------------------


def _instance(cls: type[BaseException]) -> BaseException:
    """One instance of each error class that may cross, built as its raiser builds it."""
    special: dict[type[BaseException], BaseException] = {
        errors.RefitIncomplete: errors.RefitIncomplete(3, ["a.weight", "b.weight"]),
        errors.CollectiveTimeout: errors.CollectiveTimeout(2, "bucket 4", 30.0, (0, 1)),
        errors.ConfigError: errors.ConfigError("rollout.name", "no such engine"),
        errors.InvalidTensor: errors.InvalidTensor("lm_head.weight", "holds NaN", "fix the trainer"),
        WorkerError: WorkerError("torch.OutOfMemoryError", "CUDA out of memory"),
        KeyError: KeyError("model.layers.0.mlp.gate_proj.weight"),
        errors.AdapterUpdateFailed: errors.AdapterUpdateFailed("no free adapter slot", 3),
        errors.LoraError: errors.LoraError("model.layers.0.self_attn.q_proj", "rank 8 over max_lora_rank 1", "raise it"),
    }
    return special.get(cls) or cls(f"{cls.__name__} raised in the worker")


@pytest.mark.parametrize("cls", list(p.ERRORS.values()), ids=lambda c: c.__name__)
def test_every_error_that_may_cross_is_rebuilt_as_itself(cls: type[BaseException]) -> None:
    original = _instance(cls)
    reply = p.ErrorReply.from_plain(_json(msgpack_like(p.ErrorReply.of(original).to_plain())))
    rebuilt = reply.rebuild()
    assert type(rebuilt) is cls
    assert str(rebuilt) == str(original) and rebuilt.args == original.args
    assert {k: v for k, v in vars(rebuilt).items()} == {k: v for k, v in vars(original).items()}


def test_an_error_of_another_type_becomes_a_worker_error_naming_it() -> None:
    class KernelMissing(ValueError):  # a subclass of a crossing builtin is not that builtin
        pass

    rebuilt = p.ErrorReply.of(KernelMissing("no kernel for the layer")).rebuild()
    assert type(rebuilt) is WorkerError
    assert isinstance(rebuilt, errors.EngineUpdateFailed) and isinstance(rebuilt, RuntimeError)
    assert rebuilt.remote_type.endswith("KernelMissing")
    assert str(rebuilt) == f"a vLLM worker raised {rebuilt.remote_type}: no kernel for the layer"


def test_the_first_error_of_any_worker_is_raised_even_when_worker_0_succeeded() -> None:
    answers = [p.Done().to_plain(), p.ErrorReply.of(errors.TransportAborted("rank 2: stream ended")).to_plain()]
    with pytest.raises(errors.TransportAborted, match=r"^rank 2: stream ended$"):
        p.reply_of(p.Abort(), answers)
    assert p.reply_of(p.Finalize(True), [p.FinalizeReply(1, 0.0, 2).to_plain()]) == p.FinalizeReply(1, 0.0, 2)


def test_the_worker_side_answers_an_error_instead_of_raising() -> None:
    def handler(request: p.Restore) -> p.Record:
        raise errors.RefitLifecycleError(f"restore ({request.reason}) before init")

    answered = p.answer(p.Restore, p.Restore("x").to_plain(), handler)
    assert p.ErrorReply.from_plain(answered) == p.ErrorReply("RefitLifecycleError", "restore (x) before init")
    wrong = p.answer(p.Restore, p.Abort().to_plain(), handler)  # another version's request: refused, typed
    assert p.ErrorReply.from_plain(wrong).type == "WireProtocolError"


def test_a_request_in_json_text_is_answered_json_safe() -> None:
    """vLLM's HTTP `/collective_rpc` passes JSON text and answers JSON: bytes cross base64-encoded."""
    tensors = {"w": torch.arange(4, dtype=torch.bfloat16)}
    answered = p.answer(p.LiveWeights, json.dumps(p.json_safe(p.LiveWeights().to_plain())),
                        lambda _: p.LiveWeightsReply.of(tensors))
    back = p.LiveWeightsReply.from_plain(p.from_json_safe(json.loads(json.dumps(answered)))).to_tensors()
    assert torch.equal(back["w"], tensors["w"])
    stage = p.LoraStage(3, {"r": 8}, b"\x00\xffblob")
    assert p.answer(p.LoraStage, json.dumps(p.json_safe(stage.to_plain())), lambda r: p.LoraStaged(len(r.tensors))) \
        == {"record": "LoraStaged", "modules": 6}


# --- the extension end to end, through ExtensionWorkers --------------------------------------------


def test_a_refit_through_the_extension_equals_the_trainers_weights_and_finalize_is_a_record() -> None:
    models, llm, engine = extension_engine(workers=2)
    report = RefitService(FakeTrainer(), engine, fp8_plan(), bucket_bytes=1 << 16).refit()
    assert report.ok and report.storage.ok and report.kv_scales_reset == 2
    assert llm.calls == ["rl_refit_fingerprint", "rl_refit_begin", *["rl_refit_load"] * report.buckets,
                         "rl_refit_finalize", "rl_refit_fingerprint"]
    digests = engine.digests()  # every worker's, by worker: a tensor-parallel engine holds a shard on each
    for w in (0, 1):
        own = p.DigestsReply.from_plain(llm.workers[w].rl_refit_digests(p.Digests().to_plain())).digests
        assert {n.removeprefix(f"worker{w}/"): d for n, d in digests.items() if n.startswith(f"worker{w}/")} == own
    assert len(digests) == 2 * len(own)
    assert set(engine.kv_scales()) == {f"layers.{i}.self_attn.attn" for i in range(2)}
    assert all(v == [1.0] * 4 for v in engine.kv_scales().values())
    assert torch.equal(engine.live_weights()["lm_head.weight"], models[0].lm_head.weight)


def test_a_workers_error_reaches_the_trainer_as_its_own_class_and_the_engine_goes_stale() -> None:
    models, _, engine = extension_engine(workers=2)
    models[1].fail_at_call = 1  # the second worker's second load raises RuntimeError
    with pytest.raises(errors.RefitFailed) as info:
        RefitService(FakeTrainer(), engine, fp8_plan(), bucket_bytes=1 << 16).refit()
    assert "RuntimeError: injected failure in load_weights call 1" in str(info.value)
    assert engine.is_stale
    engine.workers.begin()
    with pytest.raises(errors.RefitLifecycleError, match=r"^a vLLM refit is already loading on this worker"):
        engine.workers.begin()  # a worker's typed error, rebuilt as itself


def test_the_multiprocess_engine_carries_every_request_but_the_colocated_load() -> None:
    _, llm, engine = extension_engine()
    llm.plain = True  # vLLM's multiprocess engine: msgpack both ways
    assert engine.workers.call(p.KvScales()).scales  # a query crosses msgpack both ways
    engine.workers.begin()
    assert engine.workers.finalize(True).kv_scales_reset == 2
    with pytest.raises(AssertionError, match="not a plain value"):  # a bucket's tensors never cross msgpack
        engine.workers.call(p.Load((("lm_head.weight", torch.zeros(1)),)))
