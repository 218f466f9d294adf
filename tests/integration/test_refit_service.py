"""RefitService end to end: the report against independent counts, the canonical log line, KV-cache
scale resets, staging memory per commit mode, post-processing once, and the bootstrap builders."""

from __future__ import annotations

import pytest
import structlog
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from adapters.memory import RecordingEngine
from adapters.reference.config import MICRO_MOE
from adapters.reference.engine import KV_PLACEHOLDER, ReferenceEngine
from app.bootstrap import bootstrap
from app.services.refit import PHASES, RefitService
from app.services.transaction import Ownership
from domain.errors import ConfigError, EngineBusy, RefitFailed
from domain.quant.plan import QuantizationPlan
from domain.refit.report import RefitOutcome
from domain.refit.session import CommitMode
from tests import refit_support as rs
from tests.refit_support import one_thread  # noqa: F401  (autouse fixture)


def _service(plan=rs.DEFAULT_PLAN, **engine_kw) -> RefitService:
    engine = ReferenceEngine(MICRO_MOE, plan, **engine_kw)
    return RefitService(rs.trainer(), engine, plan, bucket_bytes=rs.SMALL_BUCKET)


def test_report_matches_independent_counts():
    svc = _service()
    named = rs.stream(svc.trainer)
    report = svc.refit()
    assert report.outcome is RefitOutcome.LIVE and report.ok
    assert report.tensors == len(named)
    assert report.bytes_sent == sum(t.numel() * t.element_size() for _, t in named)
    assert report.buckets == len(rs.buckets(named)) > 1
    assert report.source_bytes == svc.trainer.num_bytes()
    assert report.bytes_sent < report.source_bytes  # FP8 / NVFP4 are smaller than BF16
    assert set(report.timings) == set(PHASES) and all(v >= 0 for v in report.timings.values())
    assert report.timings["total"] >= report.timings["load"] + report.timings["finalize"]
    assert report.plan == "linear=FP8_BLOCK moe=NVFP4" and report.commit_mode == "transactional"
    assert report.throughput_gbps > 0 and report.to_dict()["storage"]["ok"] is True
    assert svc.reports == [report]


def test_one_canonical_log_line_per_refit():
    svc = _service()
    with structlog.testing.capture_logs() as logs:
        svc.refit()
    lines = [e for e in logs if e["event"] == "refit"]
    assert len(lines) == 1 and lines[0]["outcome"] == "live" and lines[0]["log_level"] == "info"
    assert lines[0]["buckets"] == svc.reports[-1].buckets and lines[0]["storage"] == "ok"
    svc.bucket_bytes = 1 << 30
    svc.engine.begin_refit(99)  # a refit someone else opened: ours cannot begin
    with structlog.testing.capture_logs() as logs, pytest.raises(RefitFailed, match="failed at begin"):
        svc.refit()
    assert [e["log_level"] for e in logs if e["event"] == "refit"] == ["error"]
    with pytest.raises(EngineBusy):  # the other refit was not aborted by us: still staging
        svc.engine.log_probs(rs.token_ids())


def test_quantized_refit_resets_uncalibrated_kv_scales():
    svc = _service()
    report = svc.refit()
    kv = {n: float(t) for n, t in svc.engine.live_weights().items() if n.endswith("_scale") and ".attn." in n}
    assert report.kv_scales_reset == MICRO_MOE.num_layers
    assert len(kv) == 4 * MICRO_MOE.num_layers and set(kv.values()) == {1.0}


def test_without_the_reset_the_loader_placeholders_would_stay():
    svc = _service(reset_kv_scales=False)
    assert svc.refit().kv_scales_reset == 0
    kv = [float(t) for n, t in svc.engine.live_weights().items() if ".attn." in n]
    assert set(kv) == {KV_PLACEHOLDER}


def test_calibrated_kv_scales_are_kept_with_a_kv_cache_scheme():
    engine = ReferenceEngine(MICRO_MOE, rs.DEFAULT_PLAN, kv_cache_scheme={"num_bits": 8, "type": "float"})
    named = [*rs.stream(rs.trainer()), ("model.layers.1.self_attn.k_scale", torch.tensor(0.5))]
    result = rs.full_refit(engine, rs.buckets(named))
    assert result.kv_scales_reset == 0
    live = engine.live_weights()
    assert float(live["layers.1.attn.k_scale"]) == 0.5 and float(live["layers.0.attn.k_scale"]) == 1.0


def test_bf16_refit_leaves_kv_scales_alone():
    svc = _service(QuantizationPlan.bf16())
    assert svc.refit().kv_scales_reset == 0


def test_per_layer_staging_is_bounded_by_one_commit_group():
    peaks = {}
    for mode in CommitMode:
        svc = _service(commit_mode=mode)
        svc.ownership = Ownership.REUSED  # packed buckets: the engine copies into staging
        peaks[mode] = svc.refit().peak_staging_bytes
        layout = svc.engine.layout
    group_bytes = {}
    for m in layout.modules.values():
        size = sum(torch.empty(0, dtype=d).element_size() * torch.Size(s).numel() for s, d in m.staging().values())
        group_bytes[m.group] = group_bytes.get(m.group, 0) + size
    assert peaks[CommitMode.TRANSACTIONAL] == sum(group_bytes.values())
    assert peaks[CommitMode.PER_LAYER] <= max(group_bytes.values()) < peaks[CommitMode.TRANSACTIONAL]


def test_post_processing_runs_once_per_module_and_refit():
    svc = _service()
    for _ in range(2):
        svc.refit()
        assert set(svc.engine.postprocess_counts) == set(svc.engine.layout.modules)
        assert set(svc.engine.postprocess_counts.values()) == {1}
    named = rs.stream(rs.trainer())
    recording = RecordingEngine.for_stream(named)
    svc = RefitService(rs.trainer(), recording, rs.DEFAULT_PLAN, bucket_bytes=rs.SMALL_BUCKET)
    r1, r2 = svc.refit(), svc.refit()
    assert recording.finalize_count(r1.refit_id) == recording.finalize_count(r2.refit_id) == 1
    kinds = [e[0] for e in recording.events]
    assert kinds == ["begin", *["bucket"] * r1.buckets, "finalize"] * 2
    assert [e[1] for e in recording.events if e[0] == "bucket"] == [*range(r1.buckets)] * 2


def test_progress_is_reported_after_every_bucket_and_does_not_change_the_result():
    plain, watched = _service(), _service()
    seen: list[tuple[int, int]] = []
    watched.progress = lambda done, total: seen.append((done, total))
    report = watched.refit()
    assert report.ok and len(seen) == report.buckets
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[-1] == (report.source_bytes, report.source_bytes)
    plain.refit()
    assert rs.same_bits(rs.bits(plain.engine.live_weights()), rs.bits(watched.engine.live_weights()))


MICRO = ["reference.model=micro-moe"]


def test_bootstrap_builds_the_default_service_and_probe():
    services = bootstrap(overrides=[*MICRO, "rollout.checkpoint_engine.update_weights_bucket_megabytes=0.0625",
                                    "rollout.quantization.linear=FP8_BLOCK", "rollout.quantization.moe=NVFP4"])
    svc = services.refit_service()
    assert svc.plan == rs.DEFAULT_PLAN and svc.bucket_bytes == 64 << 10
    assert svc.refit().ok
    result = services.mismatch_probe(svc).probe(rs.token_ids())
    assert result.metrics.k3_kl > 0 and result.metrics.tokens == 2 * 23


def test_bootstrap_from_config_and_its_errors():
    svc = bootstrap(
        {"rollout": {"quantization": {"linear": "MXFP8"},
                     "checkpoint_engine": {"update_weights_bucket_megabytes": 1}}},
        overrides=MICRO,
    ).refit_service()
    assert svc.plan.linear.name == "MXFP8" and not svc.plan.moe.is_quantized and svc.bucket_bytes == 1 << 20
    with pytest.raises(ConfigError, match=r"rollout\.name"):
        bootstrap({"rollout": {"name": "trtllm"}}, overrides=MICRO).refit_service()
    with pytest.raises(ConfigError, match="--inject-fault"):
        bootstrap(overrides=MICRO).refit_service(inject_fault="explode")
    with pytest.raises(ConfigError, match="commit_mode"):
        bootstrap(overrides=[*MICRO, "rollout.commit_mode=lazy"])
    with pytest.raises(ConfigError, match="bucket_megabytes"):
        bootstrap(overrides=[*MICRO, "rollout.checkpoint_engine.update_weights_bucket_megabytes=0"])


@pytest.mark.parametrize("mode", list(CommitMode))
def test_by_reference_the_engine_stages_only_the_fused_global_scales(mode):
    """In one process the buckets reference the exported tensors (nothing is packed) and the
    engine keeps views of them: the live bits equal a packed refit's, and the only staging the
    engine allocates is the per-shard global-scale slots it post-processes."""
    packed, by_ref = _service(commit_mode=mode), _service(commit_mode=mode)
    packed.ownership = Ownership.REUSED
    packed.refit()
    report = by_ref.refit()
    assert rs.same_bits(rs.bits(by_ref.engine.live_weights()), rs.bits(packed.engine.live_weights()))
    scales = [m.staging()["weight_global_scale"] for m in by_ref.engine.layout.modules.values()
              if "weight_global_scale" in m.staging()]
    slots = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in scales]
    assert slots and 0 < report.peak_staging_bytes <= sum(slots)
    assert report.buckets == packed.reports[-1].buckets  # grouped alike


class _FreshTrainer:
    """Yields a new tensor per weight and records how many it yielded are still alive at each step."""

    def __init__(self, count: int, numel: int) -> None:
        self.count, self.numel = count, numel
        self.alive_max = 0

    def named_weights(self):
        refs: list[StorageWeakRef] = []
        for i in range(self.count):
            self.alive_max = max(self.alive_max, sum(not r.expired() for r in refs))
            t = torch.full((self.numel,), float(i), dtype=torch.bfloat16)
            refs.append(StorageWeakRef(t.untyped_storage()))
            yield f"model.layers.{i}.input_layernorm.weight", t
            del t


def test_a_bucket_by_reference_does_not_outlive_its_turn():
    """By reference a bucket holds its tensors: the service must let it go before the next one is
    built, or two buckets' worth of exported tensors would be alive at once."""
    trainer = _FreshTrainer(count=40, numel=4096)  # 8 KiB each: 8 per 64 KiB bucket
    engine = RecordingEngine.for_stream(trainer.named_weights())
    svc = RefitService(trainer, engine, QuantizationPlan.bf16(), bucket_bytes=64 << 10)  # type: ignore[arg-type]
    svc.refit()
    per_bucket = (64 << 10) // (4096 * 2)
    assert svc.reports[-1].buckets == 40 // per_bucket
    assert trainer.alive_max <= per_bucket + 1  # the bucket being built and the one read ahead
