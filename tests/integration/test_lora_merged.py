"""The merged LoRA mode on the embedded engine: the adapter merged into the base at export, then the
plan's quantization and a normal refit. The engine ends up with exactly what a refit of a trainer
holding the merged weights gives, step after step, while only the adapter trains."""

from __future__ import annotations

import pytest
import torch

from adapters.reference.config import MICRO_MOE
from adapters.reference.engine import ReferenceEngine
from adapters.reference.lora import ALL_TARGETS, LoraTrainer, random_adapter
from app.services.refit import RefitService
from domain.quant.plan import QuantizationPlan
from tests import refit_support as rs
from tests.refit_support import one_thread  # noqa: F401  (autouse fixture)

PLANS = {"bf16": QuantizationPlan.bf16(), "fp8_block+nvfp4": rs.DEFAULT_PLAN,
         "mxfp8": QuantizationPlan.from_presets(linear="MXFP8", moe="MXFP8")}


def _refit(trainer: object, plan: QuantizationPlan) -> tuple[RefitService, dict[str, torch.Tensor]]:
    svc = RefitService(trainer, ReferenceEngine(MICRO_MOE, plan), plan, bucket_bytes=rs.SMALL_BUCKET)
    svc.refit()
    return svc, rs.bits(svc.engine.live_weights())


@pytest.mark.parametrize("name", list(PLANS))
def test_a_merged_refit_equals_a_refit_of_the_merged_weights(name):
    plan = PLANS[name]
    lora = LoraTrainer.from_seed(rs.trainer(), r=4)
    base_before = {n: t.clone() for n, t in lora.base.named_weights()}
    svc, merged_engine = _refit(lora, plan)
    _, plain = _refit(lora.merged(), plan)
    _, base = _refit(lora.base, plan)
    assert rs.same_bits(merged_engine, plain)
    assert not rs.same_bits(merged_engine, base)  # the adapter reached the engine
    for step in (1, 2):
        lora.perturb_(step, 0.05)
        report = svc.refit()
        assert report.ok
        _, plain = _refit(lora.merged(), plan)
        assert rs.same_bits(rs.bits(svc.engine.live_weights()), plain), f"step {step}"
    assert all(torch.equal(t, base_before[n]) for n, t in lora.base.named_weights())  # the base never moved
    assert report.bytes_sent == svc.reports[0].bytes_sent  # the merged mode sends the whole model


def test_the_merged_weights_are_the_base_plus_the_scaled_product_and_experts_pass_through():
    lora = LoraTrainer.from_seed(rs.trainer(), r=4, lora_alpha=16)
    assert lora.adapter.scaling == 4.0
    base = dict(lora.base.named_weights())
    merged = dict(lora.named_weights())
    assert list(merged) == list(base)
    adapted = {f"{m}.weight" for m in lora.adapter.modules}
    assert adapted and all(".experts." not in n for n in adapted)
    for n, t in merged.items():
        if n not in adapted:
            assert t.data_ptr() == base[n].data_ptr() and torch.equal(t, base[n])  # untouched, not copied
            continue
        w = lora.adapter.modules[n.removesuffix(".weight")]
        # plain torch, PEFT's expression on CPU: the product in float32, times the scaling, cast
        # back to the adapter's dtype, then added into the base weight
        expected = base[n].clone()
        expected += ((w.lora_B.float() @ w.lora_A.float()) * lora.adapter.scaling).to(w.lora_B.dtype)
        assert torch.equal(t, expected) and not torch.equal(t, base[n])


def test_log_probs_are_the_merged_models_and_steps_move_only_the_adapter():
    lora = LoraTrainer.from_seed(rs.trainer(), r=4)
    ids = rs.token_ids()
    lp, ent = lora.log_probs(ids)
    lp_m, ent_m = lora.merged().log_probs(ids)
    assert torch.equal(lp, lp_m) and torch.equal(ent, ent_m)
    assert not torch.equal(lp, lora.base.log_probs(ids)[0])
    saved = lora.snapshot()
    lora.perturb_(3, 0.1)
    assert not torch.equal(lora.log_probs(ids)[0], lp)
    lora.restore_(saved)
    assert torch.equal(lora.log_probs(ids)[0], lp)


def test_a_random_adapter_targets_only_the_named_projections():
    shapes = [(n, tuple(t.shape)) for n, t in rs.trainer().named_weights()]
    only_q = random_adapter(shapes, r=2, targets=("q_proj",))
    assert only_q.modules and all(m.endswith(".q_proj") for m in only_q.modules)
    every = random_adapter(shapes, r=2)
    assert {m.rsplit(".", 1)[-1] for m in every.modules} <= set(ALL_TARGETS)
    again = random_adapter(shapes, r=2)
    assert all(torch.equal(every.modules[m].lora_A, again.modules[m].lora_A) for m in every.modules)  # seeded


def test_the_lora_bench_reports_the_merged_modes_bytes_time_and_mismatch(capsys):
    from app.bench.lora_refit import FORMATS, run
    from app.cli.main import main

    report = run(quick=True, rank=4)
    by_metric: dict[str, list] = {}
    for r in report.rows:
        by_metric.setdefault(r.metric.split(" (")[0], []).append(r)
    wire = by_metric["bytes on the wire per refit"]
    assert len(wire) == len(FORMATS)
    # the merged mode sends the whole model: far more than the adapter's own bytes
    assert all(r.ratio is not None and r.ratio < 0.5 for r in wire)
    bf16 = next(r for r in by_metric["mismatch k3 KL"] if r.preset == "BF16")
    assert bf16.value == 0.0  # BF16 merged refits serve exactly the trainer's merged model
    assert main(["bench", "codecs", "--lora"]) == 2
    assert "--lora goes with the refit suite" in capsys.readouterr().err
    assert main(["bench", "refit", "--lora", "0"]) == 2
    assert "rank must be a positive integer" in capsys.readouterr().err
