"""The vLLM adapter over a CPU fake of vLLM's model, quant methods and layerwise reload."""

from __future__ import annotations

import builtins
import sys

import pytest
import torch

from adapters.vllm.engine import VllmRolloutEngine
from adapters.vllm.factory import vllm_engine_kwargs, vllm_environment
from adapters.vllm.hooks import VllmHooks
from app.services.refit import RefitService
from domain.errors import (
    BucketSequenceError,
    ConfigError,
    EngineBusy,
    EngineStale,
    RefitFailed,
    StorageRebound,
)
from domain.refit.buckets import BucketPlanner, pack_buckets, unpack_bucket
from domain.refit.report import RefitOutcome
from domain.refit.session import CommitMode
from tests.dispatching import decide_backends
from tests.engine_fakes.vllm import (
    DUMMY_KV,
    FakeLayerwise,
    FakeTrainer,
    FakeVllmModel,
    checkpoint_stream,
    fake_hooks,
    fake_log_probs,
    fp8_plan,
)

SMALL_BUCKET = 40_000  # q, k and v of one layer land in different buckets


def build(quantized: bool = True, *, copy_back: bool = True, **model_kw):  # type: ignore[no-untyped-def]
    model = FakeVllmModel(quantized=quantized, **model_kw)
    layerwise = FakeLayerwise(copy_back=copy_back)
    engine = VllmRolloutEngine.in_process(model, None, fake_hooks(layerwise), log_prob_fn=fake_log_probs(model))
    return model, layerwise, engine


def refit(engine: VllmRolloutEngine, stream, refit_id: int, bucket_bytes: int = SMALL_BUCKET):  # type: ignore[no-untyped-def]
    engine.begin_refit(refit_id)
    for bucket in pack_buckets(stream, bucket_bytes, reuse_buffer=True):
        engine.load_bucket(bucket)
    return engine.finalize_refit()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def fused_qkv(stream, layer: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The bytes layer `layer`'s fused qkv_proj must hold after a refit of `stream`."""
    sent = dict(stream)
    return as_bytes(torch.cat([sent[f"model.layers.{layer}.self_attn.{x}_proj.weight"] for x in "qkv"]))


def test_one_postprocessing_per_refit_and_one_finalize() -> None:
    model, layerwise, engine = build()
    stream = checkpoint_stream(True)
    for n in (1, 2, 3):
        refit(engine, stream, n)
        linear = [qm for qm in model.quant_methods() if hasattr(qm, "calls") and not hasattr(qm, "quant_config")]
        assert linear and all(qm.calls == n for qm in linear)
    assert (layerwise.initialized, layerwise.finalized) == (3, 3)


def test_names_sent_are_checkpoint_names_in_stream_order() -> None:
    model, _, engine = build()
    stream = checkpoint_stream(True)
    refit(engine, stream, 1)
    assert model.names_loaded == [n for n, _ in stream]
    assert "model.layers.0.self_attn.q_proj.weight_scale" in model.names_loaded


def test_layouts_land_bit_for_bit_in_kernel_storage() -> None:
    model, _, engine = build()
    stream = checkpoint_stream(True, seed=3)
    refit(engine, stream, 1)
    sent = dict(stream)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        qkv = layer.self_attn.qkv_proj
        expect = torch.cat([sent[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        assert qkv.weight.dtype == torch.float8_e4m3fn and torch.equal(as_bytes(qkv.weight), as_bytes(expect))
        scale = torch.cat([sent[p + f"self_attn.{x}_proj.weight_scale"] for x in "qkv"])
        assert torch.equal(qkv.weight_scale, scale)
        gate_up = torch.cat([sent[p + "mlp.gate_proj.weight"], sent[p + "mlp.up_proj.weight"]])
        assert torch.equal(as_bytes(layer.mlp.gate_up_proj.weight), as_bytes(gate_up))
    assert torch.equal(model.lm_head.weight, sent["lm_head.weight"])


def test_clones_before_acknowledging_reused_buffers() -> None:
    # The fake buffers a layer's tensors by reference until the layer is complete, and the
    # planner reuses one buffer for every bucket: only copies survive.
    model, _, engine = build()
    first, second = checkpoint_stream(True, seed=1), checkpoint_stream(True, seed=2)
    refit(engine, first, 1)
    refit(engine, second, 2)
    assert torch.equal(as_bytes(model.layers[1].self_attn.qkv_proj.weight), fused_qkv(second, 1))


def test_the_fake_really_aliases_uncloned_views() -> None:
    # Sensitivity of the test above: loading the views themselves corrupts the fused weight.
    model, layerwise, _ = build()
    stream = checkpoint_stream(True, seed=2)
    layerwise.initialize(model)
    for bucket in pack_buckets(stream, SMALL_BUCKET, reuse_buffer=True):
        model.load_weights(list(unpack_bucket(bucket)))
    layerwise.finalize(model, None)
    assert not torch.equal(as_bytes(model.layers[1].self_attn.qkv_proj.weight), fused_qkv(stream, 1))


def test_retained_buckets_reach_vllm_without_a_copy() -> None:
    # By reference (the colocated shape), the trainer's tensors stay valid until the refit ends:
    # the worker hands them to vLLM as they are, and the refit lands the same bytes.
    model, layerwise, engine = build()
    stream = checkpoint_stream(True, seed=4)
    engine.begin_refit(1)
    for bucket in BucketPlanner(SMALL_BUCKET, by_reference=True).pack(stream):
        assert bucket.retained
        engine.load_bucket(bucket)
    buffered = {t.data_ptr() for info in layerwise.info.values() for _, t, _ in info["loaded"]}
    engine.finalize_refit()
    assert buffered and buffered <= {t.data_ptr() for _, t in stream}  # vLLM buffered the sender's own tensors
    assert torch.equal(as_bytes(model.layers[1].self_attn.qkv_proj.weight), fused_qkv(stream, 1))


def test_buckets_not_retained_are_copied() -> None:
    _model, layerwise, engine = build()
    stream = checkpoint_stream(True, seed=4)
    engine.begin_refit(1)
    buffers = []
    for bucket in pack_buckets(stream, SMALL_BUCKET, reuse_buffer=True):
        assert not bucket.retained
        buffers.append(bucket.buffer.untyped_storage().data_ptr())
        engine.load_bucket(bucket)
    held = [t for info in layerwise.info.values() for _, t, _ in info["loaded"]]
    assert held and all(t.untyped_storage().data_ptr() not in buffers for t in held)
    engine.finalize_refit()


def test_a_live_refit_drops_the_prefix_cache_and_a_failed_one_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    # KV computed with the previous weights must not serve a prompt after the refit
    from adapters.vllm.engine import LocalWorkers

    _model, _, engine = build()
    resets: list[str] = []
    monkeypatch.setattr(LocalWorkers, "reset_prefix_cache", lambda self: resets.append("reset"))
    refit(engine, checkpoint_stream(True, seed=1), 1)
    assert resets == ["reset"]

    def fail(self: LocalWorkers, reset_kv_scales: bool) -> None:
        raise RuntimeError("injected finalize fault")

    monkeypatch.setattr(LocalWorkers, "finalize", fail)
    with pytest.raises(RuntimeError, match="injected"):  # a refit that fails goes stale instead
        refit(engine, checkpoint_stream(True, seed=2), 2)
    assert resets == ["reset"] and engine.is_stale


def test_captured_storage_is_kept() -> None:
    _model, _, engine = build()
    before = engine.storage_fingerprint()
    refit(engine, checkpoint_stream(True), 1)
    assert before.differences(engine.storage_fingerprint()) == []


@pytest.mark.parametrize("as_parameters", [False, True], ids=["buffers", "grad-parameters"])
def test_uncalibrated_kv_scales_reset_to_one(as_parameters: bool) -> None:
    model, _, engine = build(scales_as_parameters=as_parameters)
    attn = model.layers[0].self_attn.attn
    assert float(attn._k_scale.detach()) == pytest.approx(DUMMY_KV)
    assert attn._k_scale.requires_grad is as_parameters
    result = refit(engine, checkpoint_stream(True), 1)
    assert result.kv_scales_reset == 2
    for layer in model.layers:
        a = layer.self_attn.attn
        for n in ("_q_scale", "_k_scale", "_v_scale", "_prob_scale"):
            assert float(getattr(a, n).detach()) == 1.0
        assert (a._k_scale_float, a._v_scale_float, a._q_scale_float) == (1.0, 1.0, 1.0)


def test_grad_parameters_need_no_grad() -> None:
    # Why the adapter resets under no_grad: vLLM's helper fills in place.
    from tests.engine_fakes.vllm import set_default_quant_scales

    model = FakeVllmModel(scales_as_parameters=True)
    with pytest.raises(RuntimeError, match="requires grad"):
        set_default_quant_scales(model.layers[0].self_attn.attn)


def test_configs_with_kv_cache_scheme_keep_their_scales() -> None:
    model, _, engine = build(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"})
    result = refit(engine, checkpoint_stream(True), 1)
    assert result.kv_scales_reset == 0
    assert float(model.layers[0].self_attn.attn._k_scale) == pytest.approx(DUMMY_KV)


def test_bf16_refit_has_no_kv_cache_method_to_reset() -> None:
    model, _, engine = build(quantized=False)
    result = refit(engine, checkpoint_stream(False), 1)
    assert result.kv_scales_reset == 0
    assert float(model.layers[0].self_attn.attn._k_scale) == 1.0  # vLLM's own default for BF16


def test_kv_reset_can_be_turned_off() -> None:
    model, _, engine = build()
    engine.reset_kv_scales = False
    assert refit(engine, checkpoint_stream(True), 1).kv_scales_reset == 0
    assert float(model.layers[0].self_attn.attn._k_scale) == pytest.approx(DUMMY_KV)


def test_engine_serves_only_after_a_full_refit() -> None:
    _, _, engine = build()
    ids = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(EngineStale):
        engine.log_probs(ids)
    engine.begin_refit(1)
    with pytest.raises(EngineBusy):
        engine.log_probs(ids)
    for bucket in pack_buckets(checkpoint_stream(True), SMALL_BUCKET):
        engine.load_bucket(bucket)
    engine.finalize_refit()
    logp, ent = engine.log_probs(ids)
    assert logp.shape == (1, 3) and bool((logp < 0).all()) and bool((ent > 0).all())


def n_buckets() -> int:
    return sum(1 for _ in pack_buckets(checkpoint_stream(True), SMALL_BUCKET))


@pytest.mark.parametrize("fail_at", range(0, n_buckets(), 2))
def test_failure_at_any_bucket_marks_the_engine_stale(fail_at: int) -> None:
    model, layerwise, engine = build()
    refit(engine, checkpoint_stream(True, seed=1), 1)
    model.fail_at_call = model.load_calls + fail_at
    service = RefitService(FakeTrainer(seed=2), engine, fp8_plan(), bucket_bytes=SMALL_BUCKET)
    with pytest.raises(RefitFailed) as info:
        service.refit()
    assert info.value.report.outcome is RefitOutcome.STALE  # type: ignore[attr-defined]
    assert engine.is_stale and "cannot roll back" in (engine._guard.stale_reason or "")
    assert layerwise.info == {}  # the model was put back together
    with pytest.raises(EngineStale):
        engine.log_probs(torch.tensor([[1, 2]]))
    model.fail_at_call = None
    report = service.refit()  # a full refit recovers
    assert report.ok and not engine.is_stale and report.storage.ok


def test_refit_service_round_trip_reports_live() -> None:
    _, _, engine = build()
    service = RefitService(FakeTrainer(seed=4), engine, fp8_plan(), bucket_bytes=SMALL_BUCKET)
    report = service.refit()
    assert report.ok and report.commit_mode == CommitMode.PER_LAYER.value and report.kv_scales_reset == 2


def test_rebound_storage_is_caught_and_fails_closed() -> None:
    # The storage check runs in one layer, the refit service, for every engine.
    _, _, engine = build(copy_back=False)
    service = RefitService(FakeTrainer(seed=4), engine, fp8_plan(), bucket_bytes=SMALL_BUCKET)
    with pytest.raises(RefitFailed, match="captured live tensors changed") as info:
        service.refit()
    assert isinstance(info.value.__cause__, StorageRebound)
    assert engine.is_stale and info.value.report.outcome is RefitOutcome.STALE


def test_out_of_order_bucket_is_rejected() -> None:
    _, _, engine = build()
    engine.begin_refit(1)
    buckets = list(pack_buckets(checkpoint_stream(True), SMALL_BUCKET))
    with pytest.raises(BucketSequenceError):
        engine.load_bucket(buckets[1])


# --- engine arguments --------------------------------------------------------------------------


def test_engine_kwargs_carry_the_config_and_backends() -> None:
    decision = decide_backends("vllm", fp8_plan(), (9, 0))
    qc = {"quant_method": "compressed-tensors", "config_groups": {}}
    kw = vllm_engine_kwargs(qc, decision, kv_cache_dtype="fp8",
                            base={"model": "/m", "hf_overrides": {"max_position_embeddings": 64,
                                                                  "quantization_config": {"old": 1}}})
    assert kw["hf_overrides"] == {"max_position_embeddings": 64, "quantization_config": qc}
    assert (kw["quantization"], kw["linear_backend"], kw["moe_backend"]) == ("compressed-tensors", "deep_gemm", "auto")
    assert kw["kv_cache_dtype"] == "fp8" and kw["model"] == "/m"
    env = vllm_environment(decision, colocated=False)
    assert env["VLLM_USE_DEEP_GEMM"] == "1" and env["VLLM_USE_DEEP_GEMM_E8M0"] == "0"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert "VLLM_MOE_USE_DEEP_GEMM" not in env


def test_bf16_engine_kwargs_drop_the_quantization_config() -> None:
    decision = decide_backends("vllm", fp8_plan(False), None, opt_out=True)
    kw = vllm_engine_kwargs(None, decision, base={"hf_overrides": {"quantization_config": {"x": 1}}})
    assert "hf_overrides" not in kw and "quantization" not in kw
    assert vllm_environment(decision, colocated=True) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                                          "VLLM_LOGGING_STREAM": "ext://sys.stderr",
                                                          "RL_REFIT_VLLM_CPU_EMULATION": "auto"}


def test_engine_kwargs_reject_bad_inputs() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.name"):
        vllm_engine_kwargs(None, decide_backends("sglang", fp8_plan(), None))
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        vllm_engine_kwargs(None, decide_backends("vllm", fp8_plan(), None), kv_cache_dtype="int3")


def test_missing_vllm_names_the_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    with pytest.raises(ModuleNotFoundError, match=r"adapters\.vllm .*needs vllm >=0\.32,<0\.34") as info:
        VllmHooks.from_vllm()
    assert info.value.name == "vllm"


def test_expected_layout_rejects_a_repeated_tensor_before_vllm_sees_it() -> None:
    import attrs

    from domain.errors import EngineTensorMismatch
    from domain.refit.engine_layout import layout_of

    model, _, engine = build()
    named = checkpoint_stream(True)
    engine.expected_layout = layout_of(named)
    engine.begin_refit(1)
    first = next(iter(pack_buckets(named, SMALL_BUCKET)))
    assert not first.is_last
    engine.load_bucket(first)
    calls = model.load_calls
    with pytest.raises(EngineTensorMismatch, match="arrived twice"):
        engine.load_bucket(attrs.evolve(first, index=1))
    assert model.load_calls == calls and engine.is_stale


def test_launch_without_vllm_names_the_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    from adapters.vllm.client import start_llm

    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    with pytest.raises(ModuleNotFoundError, match=r"adapters\.vllm .*needs vllm >=0\.32,<0\.34"):
        start_llm(model="/m")


def test_greedy_continuations_are_asked_one_request_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batched, which requests share a decode step would follow their arrival at the scheduler."""
    import types

    from adapters.vllm.client import greedy_tokens

    fake_vllm = types.ModuleType("vllm")
    fake_vllm.SamplingParams = lambda **kw: kw  # type: ignore[attr-defined]
    fake_inputs = types.ModuleType("vllm.inputs")
    fake_inputs.TokensPrompt = lambda prompt_token_ids: list(prompt_token_ids)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", fake_inputs)

    class Llm:
        def __init__(self) -> None:
            self.calls: list[list[list[int]]] = []

        def generate(self, prompts, params, use_tqdm, lora_request):  # type: ignore[no-untyped-def]
            assert params == {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
            self.calls.append(prompts)
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=(p[0] + 1, p[-1] + 1))])
                    for p in prompts]

    llm = Llm()
    assert greedy_tokens(llm, [[1, 2, 3], [10, 20], [7]], 2) == [[2, 4], [11, 21], [8, 8]]
    assert llm.calls == [[[1, 2, 3]], [[10, 20]], [[7]]]


# --- what a refit wrote, experts, plain values across process boundaries -----------------------


def test_finalize_reports_every_parameter_written_and_none_unwritten() -> None:
    model, _, engine = build()
    result = refit(engine, checkpoint_stream(True), 1)
    expected = {n for n, _ in model.named_parameters()
                if n.rpartition(".")[2] not in ("q_scale", "k_scale", "v_scale", "prob_scale")}
    assert result.parameters_written == len(expected) and result.unwritten == ()


def test_a_refit_that_misses_tensors_fails_closed_naming_them() -> None:
    class Missing(FakeTrainer):
        def named_weights(self) -> list[tuple[str, torch.Tensor]]:
            return [(n, t) for n, t in super().named_weights() if "layers.1.mlp.down_proj" not in n]

    _, _, engine = build()
    svc = RefitService(Missing(), engine, fp8_plan(), bucket_bytes=SMALL_BUCKET)
    with pytest.raises(RefitFailed, match=r"RefitIncomplete.*never written \(layers\.1\.mlp\.down_proj\.weight") as info:
        svc.refit()
    report = info.value.report
    assert report.outcome is RefitOutcome.STALE and engine.is_stale
    assert "layers.1.mlp.down_proj.weight" in report.unwritten and report.parameters_written is not None
    svc_full = RefitService(FakeTrainer(), engine, fp8_plan(), bucket_bytes=SMALL_BUCKET)
    assert svc_full.refit().ok and not engine.is_stale  # the next full refit recovers


def test_activation_scales_of_a_kind_the_checkpoint_never_carries_are_not_expected() -> None:
    # vLLM's NVFP4 expert method allocates w13/w2_input_global_scale for weight-only checkpoints too:
    # no load, cold start or refit, ever writes them, so the audit does not ask for them
    model, _, engine = build()
    layer = next(m for n, m in model.named_modules() if n.endswith("mlp"))
    layer.register_parameter("w13_input_global_scale", torch.nn.Parameter(torch.ones(2), requires_grad=False))
    result = refit(engine, checkpoint_stream(True), 1)
    assert result.unwritten == () and not engine.is_stale
    # a parameter of any other kind that nothing writes is still missing
    layer.register_parameter("w13_extra_weight", torch.nn.Parameter(torch.ones(2), requires_grad=False))
    assert [n for n in refit(engine, checkpoint_stream(True), 2).unwritten if n.endswith("w13_extra_weight")]


def test_experts_the_reload_cannot_redo_are_refused_before_anything_is_written() -> None:
    import attrs

    from adapters.vllm.errors import EngineRefitUnsupported

    _, layerwise, engine = build()
    refit(engine, checkpoint_stream(True), 1)

    def refuse(_model: torch.nn.Module) -> int:
        raise EngineRefitUnsupported("experts padded: refused")

    engine.workers.refit.hooks = attrs.evolve(engine.workers.refit.hooks, check_experts=refuse)  # type: ignore[attr-defined]
    before = {n: t.detach().clone() for n, t in engine.live_weights().items()}
    with pytest.raises(EngineRefitUnsupported):
        engine.begin_refit(2)
    assert not engine.is_stale and layerwise.initialized == 1  # nothing began, the old weights serve
    assert all(torch.equal(before[n], t) for n, t in engine.live_weights().items())
    engine.log_probs(torch.tensor([[1, 2, 3]]))


def test_the_expert_redo_gets_the_names_the_loads_wrote() -> None:
    import attrs

    seen: list[set[str]] = []
    model, _, engine = build()
    hooks = engine.workers.refit.hooks  # type: ignore[attr-defined]
    engine.workers.refit.hooks = attrs.evolve(hooks, redo_experts=lambda m, w: seen.append(set(w)) or 3)  # type: ignore[attr-defined]
    refit(engine, checkpoint_stream(True), 1)
    assert seen == [{n for n, _ in model.named_parameters() if n.rpartition(".")[2] not in ("q_scale", "k_scale", "v_scale", "prob_scale")}]


def test_finalize_stats_and_fingerprints_survive_plain_values() -> None:
    import json

    import attrs

    from adapters.vllm.protocol import FinalizeReply
    from adapters.vllm.worker import FinalizeStats
    from domain.refit.storage import StorageFingerprint

    stats = FinalizeStats(2, 0.5, 30, 28, ("a.weight",), 1)
    reply = FinalizeReply(**stats._asdict())
    assert FinalizeReply.from_plain(json.loads(json.dumps(reply.to_plain()))) == reply
    assert tuple(attrs.astuple(reply)) == tuple(stats)
    _, _, engine = build()
    fp = engine.storage_fingerprint()
    assert StorageFingerprint.from_plain(json.loads(json.dumps(fp.to_plain()))) == fp


# --- tied word embeddings (issue 24) -------------------------------------------------------------


def test_tied_parameters_are_read_from_shared_storage() -> None:
    from adapters.vllm.worker import tied_parameters

    assert tied_parameters(FakeVllmModel(tied=True)) == {"lm_head.weight": "embed_tokens.weight"}
    assert tied_parameters(FakeVllmModel()) == {}


@pytest.mark.parametrize("quantized", [True, False])
def test_a_tied_model_refits_without_lm_head_and_its_head_follows_the_embeddings(quantized) -> None:
    model, _, engine = build(quantized, tied=True)
    svc = RefitService(FakeTrainer(tied=True), engine, fp8_plan(quantized), bucket_bytes=SMALL_BUCKET)
    report = svc.refit()
    assert report.ok and report.unwritten == () and not engine.is_stale
    assert "lm_head.weight" not in model.names_loaded
    assert model.lm_head.weight is model.embed_tokens.weight  # still one storage after the reload
    embed = dict(FakeTrainer(tied=True).named_weights())["model.embed_tokens.weight"]
    assert torch.equal(model.lm_head.weight, embed)
    svc.trainer = FakeTrainer(seed=1, tied=True)
    assert svc.refit().ok
    embed = dict(FakeTrainer(1, tied=True).named_weights())["model.embed_tokens.weight"]
    assert torch.equal(model.lm_head.weight, embed)
    # the head's copy outside the parameters (vLLM's CPU packing) follows too: serving is the new weights
    assert torch.equal(model.lm_head.packed, embed)
    ids = torch.tensor([[1, 5, 9, 3]])
    logits = embed[ids[:, :-1]].float() @ embed.float().t()
    assert torch.equal(engine.log_probs(ids)[0], torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0])


def test_a_tied_model_whose_embeddings_are_missing_still_fails_closed_naming_both() -> None:
    class NoEmbed(FakeTrainer):
        def named_weights(self) -> list[tuple[str, torch.Tensor]]:
            return [(n, t) for n, t in super().named_weights() if "embed_tokens" not in n]

    _, _, engine = build(tied=True)
    svc = RefitService(NoEmbed(tied=True), engine, fp8_plan(), bucket_bytes=SMALL_BUCKET)
    with pytest.raises(RefitFailed, match=r"RefitIncomplete") as info:
        svc.refit()
    assert {"embed_tokens.weight", "lm_head.weight"} <= set(info.value.report.unwritten)


def test_an_untied_model_still_needs_its_lm_head() -> None:
    _, _, engine = build()
    svc = RefitService(FakeTrainer(tied=True), engine, fp8_plan(), bucket_bytes=SMALL_BUCKET)
    with pytest.raises(RefitFailed, match=r"never written \(lm_head\.weight\)"):
        svc.refit()
