"""The SGLang adapter and its custom loader over a CPU fake of SGLang's engine and model."""

from __future__ import annotations

import pytest
import torch

from adapters.sglang import loader as refit_loader
from adapters.sglang.engine import SglangRolloutEngine
from adapters.sglang.engine_args import sglang_engine_kwargs
from adapters.sglang.staging import BEGIN_MARKER, LOADER_PATH, StagingRule
from app.services.refit import RefitService
from domain.errors import (
    ConfigError,
    EngineRejectsQuantization,
    EngineStale,
    QuantizedDeltaSync,
    RefitFailed,
    StorageRebound,
)
from domain.quant.stream import quantize_stream
from domain.refit.buckets import pack_buckets
from domain.refit.report import RefitOutcome
from domain.refit.session import CommitMode
from tests.dispatching import decide_backends
from tests.engine_fakes.sglang import (
    LAYERS,
    UNSENT,
    FakeMxfp8LinearMethod,
    FakeSglangEngine,
    FakeSglangModel,
    FakeTrainer,
    plan_for,
    swizzle,
    trainer_weights,
)

BUCKET = 12_000  # several buckets per layer: scales and experts straddle buckets
H_ = 64


def build(linear="MXFP8", moe=None, *, native_mxfp8=True, plan_native=None, **kw):  # type: ignore[no-untyped-def]
    model = FakeSglangModel(linear=linear, moe=moe)
    fake = FakeSglangEngine(model)
    native = native_mxfp8 and linear == "MXFP8"
    plan = plan_for(linear, moe, native if plan_native is None else plan_native)
    engine = SglangRolloutEngine(fake, plan, native_mxfp8=native, **kw)
    return model, fake, engine, plan


def stream(plan, seed: int = 0):  # type: ignore[no-untyped-def]
    return list(quantize_stream(plan, trainer_weights(seed)))


def refit(engine, named, refit_id: int):  # type: ignore[no-untyped-def]
    engine.begin_refit(refit_id)
    for bucket in pack_buckets(named, BUCKET, reuse_buffer=True):
        engine.load_bucket(bucket)
    return engine.finalize_refit()


def snapshot(model) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    return {n: t.detach().clone() for n, t in (dict(model.named_parameters()) | dict(model.named_buffers())).items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_one_rebuild_per_refit_despite_sglangs_end_of_session_postprocessing() -> None:
    model, _fake, engine, plan = build()
    for n in (1, 2, 3):
        refit(engine, stream(plan, n), n)
        assert all(qm.calls == n for qm in model.quant_methods())
    assert refit_loader.disarm_skip_guards(model) > 0  # SGLang's own pass was skipped by the guards
    assert refit_loader.disarm_skip_guards(model) == 0  # idempotent


def test_mxfp8_scales_are_staged_and_land_swizzled_in_captured_storage() -> None:
    model, fake, engine, plan = build()
    named = stream(plan, seed=5)
    before = fake.storage_fingerprint()
    result = refit(engine, named, 1)
    sent = dict(named)
    scale_calls = [i for i, names in enumerate(model.calls) for n in names if n.endswith("weight_scale_inv")]
    assert scale_calls and set(scale_calls) == {len(model.calls) - 1}  # all in the final load
    assert result.peak_staging_bytes == sum(t.nbytes for n, t in named if n.endswith("weight_scale_inv"))
    for i in range(LAYERS):
        p = f"model.layers.{i}.self_attn."
        qkv = model.layers[i].qkv_proj
        assert torch.equal(as_bytes(qkv.weight), as_bytes(torch.cat([sent[p + f"{x}_proj.weight"] for x in "qkv"])))
        scales = torch.cat([sent[p + f"{x}_proj.weight_scale_inv"] for x in "qkv"])
        assert torch.equal(qkv.weight_scale_inv, swizzle(scales))
    assert before.differences(fake.storage_fingerprint()) == []


def test_native_mxfp8_translates_weight_scale_to_weight_scale_inv() -> None:
    model, _fake, engine, plan = build(plan_native=False)  # the trainer names scales weight_scale
    named = stream(plan, seed=2)
    assert any(n.endswith(".weight_scale") for n, _ in named)
    refit(engine, named, 1)
    sent = dict(named)
    expect = swizzle(torch.cat([sent[f"model.layers.0.self_attn.{x}_proj.weight_scale"] for x in "qkv"]))
    assert torch.equal(model.layers[0].qkv_proj.weight_scale_inv, expect)
    assert StagingRule(native_mxfp8=True).engine_name("a.weight_scale") == "a.weight_scale_inv"


def test_fp4_experts_are_staged_into_one_load() -> None:
    model, _fake, engine, plan = build(linear=None, moe="MXFP4")
    named = stream(plan, seed=3)
    refit(engine, named, 1)
    sent = dict(named)
    expert_calls = {i for i, names in enumerate(model.calls) for n in names if ".experts." in n}
    assert expert_calls == {len(model.calls) - 1}
    moe = model.layers[1].experts
    e0 = "model.layers.1.mlp.experts.0."
    # the fake kernel layout reverses expert order: expert 0 lands last
    assert torch.equal(moe.w13_weight_packed[-1], torch.cat([sent[e0 + "gate_proj.weight_packed"],
                                                            sent[e0 + "up_proj.weight_packed"]]))
    assert torch.equal(moe.w2_weight_scale[-1], sent[e0 + "down_proj.weight_scale"])


def test_without_staging_the_fp4_loader_fails_and_nothing_changes() -> None:
    # Sensitivity: the fake's FP4 loader really needs every expert tensor at once.
    model, fake, engine, plan = build(linear=None, moe="MXFP4")
    refit(engine, stream(plan, 1), 1)
    live = snapshot(model)
    engine._rule = StagingRule()  # stage nothing
    with pytest.raises(RuntimeError, match="needs all"):
        refit(engine, stream(plan, 2), 2)
    assert same(live, snapshot(model)) and not fake.session


def test_clones_staged_tensors_out_of_the_reused_buffer() -> None:
    model, _fake, engine, plan = build()
    refit(engine, stream(plan, 1), 1)
    named = stream(plan, 2)
    refit(engine, named, 2)  # reuse_buffer=True: later buckets overwrite earlier bytes
    scales = torch.cat([dict(named)[f"model.layers.1.self_attn.{x}_proj.weight_scale_inv"] for x in "qkv"])
    assert torch.equal(model.layers[1].qkv_proj.weight_scale_inv, swizzle(scales))


def n_buckets(plan) -> int:  # type: ignore[no-untyped-def]
    return sum(1 for _ in pack_buckets(stream(plan), BUCKET))


@pytest.mark.parametrize("fail_at", range(0, n_buckets(plan_for("MXFP8", None, True)), 3))
def test_failure_at_any_bucket_leaves_live_weights_intact(fail_at: int) -> None:
    model, fake, engine, plan = build()
    service = RefitService(FakeTrainer(seed=1), engine, plan, bucket_bytes=BUCKET)
    assert service.refit().ok
    live = snapshot(model)
    real_load = model.load_weights
    calls = {"n": 0}

    def failing(weights):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == fail_at + 1:
            raise RuntimeError("injected load failure")
        return real_load(weights)

    model.load_weights = failing
    service.trainer = FakeTrainer(seed=2)
    with pytest.raises(RefitFailed) as info:
        service.refit()
    assert info.value.report.outcome is RefitOutcome.ROLLED_BACK  # type: ignore[attr-defined]
    assert same(live, snapshot(model)) and not engine.is_stale and not fake.session
    model.load_weights = real_load
    assert service.refit().ok  # the next refit goes through


def test_a_failure_before_a_layer_is_written_has_not_backed_it_up() -> None:
    model, _fake, engine, plan = build()
    refit(engine, stream(plan, 1), 1)
    live = snapshot(model)
    first = next(iter(pack_buckets(stream(plan, 2), BUCKET)))
    reached = {refit_loader.backup_group(m.name) for m in first.metas}  # what the first bucket writes
    assert "layers.1" not in reached
    real_load = model.load_weights
    model.load_weights = lambda weights: (_ for _ in ()).throw(RuntimeError("injected"))  # the first load fails
    with pytest.raises(RuntimeError, match="injected"):
        refit(engine, stream(plan, 2), 2)
    model.load_weights = real_load
    loader = refit_loader.loader_for(model)
    assert loader is not None and {refit_loader.backup_group(n) for n in loader.backed_up} <= reached
    every = dict(model.named_parameters()) | dict(model.named_buffers())
    assert loader.peak_backup_bytes == sum(every[n].nbytes for n in loader.backed_up)
    assert loader.peak_backup_bytes < sum(t.nbytes for n, t in every.items() if not n.startswith(UNSENT))
    assert same(live, snapshot(model)) and not engine.is_stale


def test_postprocessing_failure_restores_layers_already_rebuilt() -> None:
    model, _fake, engine, plan = build()
    refit(engine, stream(plan, 1), 1)
    live = snapshot(model)
    model.layers[1].o_proj.quant_method.fail = True  # layer 0 is rebuilt before this raises
    with pytest.raises(RuntimeError, match="injected post-processing failure"):
        refit(engine, stream(plan, 2), 2)
    assert same(live, snapshot(model)) and not engine.is_stale
    assert isinstance(model.layers[1].o_proj.quant_method, FakeMxfp8LinearMethod)


def test_a_shape_change_in_postprocessing_fails_closed_and_restores() -> None:
    model, fake, engine, plan = build()
    refit(engine, stream(plan, 1), 1)
    live = snapshot(model)
    before = fake.storage_fingerprint()
    model.layers[0].qkv_proj.quant_method.reshape = True
    with pytest.raises(StorageRebound, match="captured storage cannot hold it"):
        refit(engine, stream(plan, 2), 2)
    assert same(live, snapshot(model)) and before.differences(fake.storage_fingerprint()) == []


# --- the backup: only what a refit overwrites --------------------------------------------------------


@pytest.mark.parametrize(("linear", "moe"), [("MXFP8", None), (None, "MXFP4"), (None, None)])
def test_a_refit_backs_up_what_it_overwrites_and_nothing_else(linear, moe) -> None:  # type: ignore[no-untyped-def]
    model, _fake, engine, plan = build(linear=linear, moe=moe)
    refit(engine, stream(plan, 1), 1)
    loader = refit_loader.loader_for(model)
    assert loader is not None
    every = dict(model.named_parameters()) | dict(model.named_buffers())
    written = {n for n in every if not n.startswith(UNSENT)}  # the layers, embeddings and head the stream reaches
    assert set(loader.backed_up) == written
    assert loader.peak_backup_bytes == sum(every[n].nbytes for n in written)
    assert loader.peak_backup_bytes < sum(t.nbytes for t in every.values())  # the old BEGIN copied everything
    # layer by layer, in stream order: the embedding first, then layer 0 before layer 1
    order = [refit_loader.backup_group(n) for n in loader.backed_up]
    assert order.index("embed_tokens") < order.index("layers.0") < order.index("layers.1")


def test_a_tensor_for_a_layer_the_engine_lacks_backs_up_the_modules_outside_the_layers() -> None:
    model, fake, engine, plan = build()
    refit(engine, stream(plan, 1), 1)
    live = snapshot(model)
    stray = ("model.layers.9.self_attn.o_proj.weight", torch.zeros(H_, H_, dtype=torch.bfloat16))
    with pytest.raises(IndexError):  # the fake's load_weights has no layer 9
        refit(engine, [stray, *stream(plan, 2)], 2)
    loader = refit_loader.loader_for(model)
    assert loader is not None
    groups = {refit_loader.backup_group(n) for n in loader.backed_up}
    assert groups == {"embed_tokens", "lm_head", "rotary_emb", "vision_tower"}
    assert same(live, snapshot(model)) and not fake.session


def test_a_tied_weight_is_backed_up_once_and_restored() -> None:
    model, _fake, engine, plan = build(linear=None)
    model.lm_head.weight = model.embed_tokens.weight  # one Parameter under two modules
    refit(engine, stream(plan, 1), 1)
    live = snapshot(model)
    loader = refit_loader.loader_for(model)
    assert loader is not None and {"embed_tokens.weight", "lm_head.weight"} <= set(loader.backed_up)
    every = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    distinct = {t.data_ptr(): t.nbytes for n, t in every.items() if not n.startswith(UNSENT)}
    assert loader.peak_backup_bytes == sum(distinct.values())
    model.layers[1].experts.load_experts = lambda named: (_ for _ in ()).throw(RuntimeError("injected"))
    with pytest.raises(RuntimeError, match="injected"):
        refit(engine, stream(plan, 2), 2)
    assert same(live, snapshot(model))


class _SharedBuffer(torch.nn.Module):
    """Two layers whose buffers are overlapping views of one storage (a shared workspace)."""

    def __init__(self) -> None:
        super().__init__()
        storage = torch.arange(16, dtype=torch.float32)
        self.layers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
        self.layers[0].register_buffer("ws", storage[0:10])
        self.layers[1].register_buffer("ws", storage[5:15])
        self.layers[0].weight = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.layers[1].weight = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            if name == "boom":
                raise RuntimeError("injected")
            layer = self.layers[int(name.split(".")[2])]
            layer.weight.data.copy_(t)
            layer.ws.data.fill_(-1.0)  # writes the storage layer 1 shares


def test_storage_shared_across_layers_is_restored_to_its_pre_refit_value() -> None:
    model = _SharedBuffer()
    before = model.layers[0].ws.clone(), model.layers[1].ws.clone()
    refit_loader.load(model, [(BEGIN_MARKER, StagingRule().to_tensor(1))])
    refit_loader.load(model, [("model.layers.0.x.weight", torch.ones(4))])  # layer 0 backed up, then written
    with pytest.raises(RuntimeError, match="injected"):  # layer 1 backed up after the shared part changed
        refit_loader.load(model, [("model.layers.1.x.weight", torch.ones(4)), ("boom", torch.ones(1))])
    assert torch.equal(model.layers[0].ws, before[0]) and torch.equal(model.layers[1].ws, before[1])
    assert torch.equal(model.layers[0].weight, torch.zeros(4))


def test_serving_and_commit_mode() -> None:
    _, _, engine, plan = build(log_prob_fn=lambda ids, t: (torch.zeros(1), torch.zeros(1)))
    assert engine.commit_mode is CommitMode.TRANSACTIONAL
    with pytest.raises(EngineStale):
        engine.log_probs(torch.tensor([[1, 2]]))
    refit(engine, stream(plan), 1)
    assert engine.log_probs(torch.tensor([[1, 2]]))[0].shape == (1,)


def test_final_call_flushes_the_cache() -> None:
    _, fake, engine, plan = build()
    refit(engine, stream(plan), 1)
    assert fake.flushes == 1


def test_loader_rejects_tensors_before_begin() -> None:
    model = FakeSglangModel()
    with pytest.raises(Exception, match="before the BEGIN marker"):
        refit_loader.load(model, [("model.layers.0.self_attn.o_proj.weight", torch.zeros(1))])


def test_loader_rejects_a_misplaced_marker() -> None:
    model = FakeSglangModel()
    refit_loader.load(model, [(BEGIN_MARKER, StagingRule().to_tensor(1))])
    with pytest.raises(Exception, match="out of place"):
        refit_loader.load(model, [("x", torch.zeros(1)), (BEGIN_MARKER, torch.zeros(1)), ("y", torch.zeros(1))])
    assert not refit_loader.loader_for(model).active  # type: ignore[union-attr]


def test_staging_rule_round_trips_through_the_begin_marker() -> None:
    rule = StagingRule(mxfp8_scales=True, fp4_experts=False, native_mxfp8=True)
    assert StagingRule.from_tensor(rule.to_tensor(42)) == (42, rule)
    nv = StagingRule.for_plan(plan_for(None, "NVFP4"))
    assert nv.must_stage("m.layers.0.mlp.experts.3.up_proj.weight_global_scale")
    assert not nv.must_stage("m.layers.0.self_attn.q_proj.weight_packed")


# --- rejections (docs/plan.md#enginesupportmatrix) -----------------------------------------------


def test_rejects_mxfp8_linear_with_mxfp4_moe() -> None:
    with pytest.raises(EngineRejectsQuantization, match="MXFP8 with moe=MXFP4"):
        SglangRolloutEngine(FakeSglangEngine(FakeSglangModel()), plan_for("MXFP8", "MXFP4"))


def test_rejects_per_token_nvfp4() -> None:
    with pytest.raises(EngineRejectsQuantization, match="per-token NVFP4"):
        SglangRolloutEngine(FakeSglangEngine(FakeSglangModel()), plan_for(None, "NVFP4"))


@pytest.mark.parametrize(("backend", "wire"), [("delta_sharded", None), (None, "delta_flush")])
def test_rejects_delta_sync_for_quantized_rollouts(backend, wire) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(QuantizedDeltaSync):
        SglangRolloutEngine(FakeSglangEngine(FakeSglangModel()), plan_for("MXFP8", None),
                            sync_backend=backend, wire_format=wire)


# --- server arguments ----------------------------------------------------------------------------


def test_server_kwargs() -> None:
    decision = decide_backends("sglang", plan_for("MXFP8", "MXFP8", True), (10, 0))  # the native MXFP8 layout
    qc = {"quant_method": "mxfp8", "weight_block_size": [1, 32]}
    kw = sglang_engine_kwargs(qc, decision, base={"model_path": "/m", "custom_weight_loader": ["x.y"],
                                                  "json_model_override_args": '{"rope_theta": 1}'})
    import json

    assert json.loads(kw["json_model_override_args"]) == {"rope_theta": 1, "quantization_config": qc}
    assert kw["quantization"] == "mxfp8" and kw["custom_weight_loader"] == ["x.y", LOADER_PATH]
    assert (kw["moe_runner_backend"], kw["fp8_gemm_runner_backend"]) == ("deep_gemm", "deep_gemm")
    bf16 = sglang_engine_kwargs(None, decide_backends("sglang", plan_for(None, None), None))
    assert "quantization" not in bf16 and bf16["moe_runner_backend"] == "auto"
    with pytest.raises(ConfigError):
        sglang_engine_kwargs(None, decide_backends("vllm", plan_for(None, None), None))


def test_missing_sglang_names_the_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from adapters.sglang.client import EngineClient

    real_import = builtins.__import__

    def no_sglang(name, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == "sglang" or name.startswith("sglang."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sglang)
    with pytest.raises(ModuleNotFoundError, match=r"adapters\.sglang .*needs sglang==0\.5\.23") as info:
        EngineClient.launch(model_path="/m")
    assert info.value.name == "sglang"
