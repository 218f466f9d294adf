"""`refit bench engine` without an engine: settings, deployment and skip decisions, the report
built from given timings, the rounds' order, and how `refit bench all` takes the suite."""

from __future__ import annotations

import statistics

import pytest

import app.bench
from adapters.vllm.bench import BASELINES
from app.bench import engine
from app.bench.all import AllResult, SuiteResult, markdown, run_suite
from app.bench.engine import (
    COPY,
    RECEIVE,
    RESTART,
    EngineBenchSettings,
    EngineTimings,
    build_report,
    resolve_deployment,
    skip_reason,
    speed_target,
    time_split,
)
from app.bench.figures import group_rows

# vLLM's baselines, the engine the bench measures by default (its plugin's EngineBaselines)
RELOAD, LAYERWISE, WRITE_RELOAD, LOAD_WEIGHTS = (BASELINES.labels[k] for k in
                                                 ("reload", "layerwise", "write_reload", "load_weights"))
TERMS = BASELINES.terms

REFIT = (0.3, 0.1, 0.2)
WRITE = (0.01, 0.2, 0.06)
RELOADS = (0.4, 0.2, 0.3)  # write + reload per round: 0.41, 0.40, 0.36 -> median 0.40 (not 0.06 + 0.30)
LOADS = (0.05, 0.1, 0.15)


def timings(**kw: object) -> EngineTimings:
    base: dict[str, object] = dict(deployment="colocated", start=10.0, refit=REFIT, write=WRITE, reload=RELOADS,
                                   load_weights=LOADS, source_bytes=2_000_000, sent_bytes=1_000_000, buckets=2,
                                   same_bytes=True, moved=True)
    return EngineTimings(**{**base, **kw})  # type: ignore[arg-type]


# --- settings --------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "option"), [
    ({"deployment": "local"}, "deployment"),
    ({"preset": "NVFP4"}, "preset"),
    ({"repeat": 0}, "repeat"),
    ({"trainer_threads": 0}, "trainer_threads"),
])
def test_bad_settings_name_the_option(kwargs: dict[str, object], option: str) -> None:
    with pytest.raises(ValueError, match=rf"^{option} must be"):
        EngineBenchSettings(**kwargs)  # type: ignore[arg-type]


def test_settings_accept_what_the_cpu_build_serves() -> None:
    assert EngineBenchSettings(preset="fp8_block").preset == "fp8_block"  # any case
    assert EngineBenchSettings(preset="BF16", deployment="disaggregated").deployment == "disaggregated"


def test_defaults() -> None:
    quick, full = EngineBenchSettings.defaults(True), EngineBenchSettings.defaults(False)
    assert (quick.model, quick.repeat, quick.bucket_mb) == ("micro-moe", 3, 1.0)
    assert (full.model, full.repeat, full.bucket_mb) == ("tiny-moe", 7, 4.0)


def test_trainer_threads() -> None:
    auto = EngineBenchSettings()
    assert auto.trainer_threads_for("disaggregated", 2, cuda=False) == 1  # the other core: the vLLM server's
    assert auto.trainer_threads_for("disaggregated", 16, cuda=False) == 8
    assert auto.trainer_threads_for("disaggregated", 1, cuda=False) == 1
    assert auto.trainer_threads_for("disaggregated", 16, cuda=True) is None  # quantizing runs on the GPU
    assert auto.trainer_threads_for("colocated", 16, cuda=False) is None  # vLLM sets them in its process
    assert EngineBenchSettings(trainer_threads=3).trainer_threads_for("colocated", 16, cuda=False) == 3


# --- deployment and skipping -----------------------------------------------------------------


def test_resolve_deployment() -> None:
    assert resolve_deployment("auto", engine_here=True) == "colocated"
    assert resolve_deployment("auto", engine_here=False) == "disaggregated"
    assert resolve_deployment("disaggregated", engine_here=True) == "disaggregated"
    assert resolve_deployment("colocated", engine_here=False) == "colocated"


def test_skip_reasons() -> None:
    colocated = skip_reason("colocated", BASELINES, engine_here=False)
    assert colocated is not None and "needs vLLM in this process" in colocated and ".venv-vllm/bin/python" in colocated
    remote = skip_reason("disaggregated", BASELINES, engine_here=False, engine_python="/opt/py",
                         engine_python_has_it=False)
    assert remote is not None and "/opt/py" in remote and "RL_REFIT_VLLM_PYTHON" in remote
    assert "scripts/setup-vllm-env.sh" in remote
    assert skip_reason("colocated", BASELINES, engine_here=True) is None
    assert skip_reason("disaggregated", BASELINES, engine_here=False, engine_python="/opt/py",
                       engine_python_has_it=True) is None


def test_measure_raises_module_not_found_naming_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "_engine_here", lambda package: False)
    monkeypatch.setattr(engine, "python_has", lambda python, package: False)
    with pytest.raises(ModuleNotFoundError, match="where vLLM does not import") as err:
        engine.measure(EngineBenchSettings(deployment="disaggregated"))
    assert err.value.name == "vllm"


def test_bench_all_reports_the_suite_skipped_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    assert app.bench.SUITES["engine"] == "app.bench.engine"
    monkeypatch.setattr(engine, "_engine_here", lambda package: False)
    monkeypatch.setattr(engine, "python_has", lambda python, package: False)
    res = run_suite("engine", app.bench.SUITES["engine"], True)
    assert res.status == "skipped", res.error
    assert res.error is not None and "RL_REFIT_VLLM_PYTHON" in res.error


# --- the report ------------------------------------------------------------------------------


def test_rows_compare_the_refit_median_with_each_baseline_median() -> None:
    settings = EngineBenchSettings(preset="FP8_BLOCK", repeat=3)
    report = build_report(settings, timings())
    refit = statistics.median(REFIT)
    rows = {r.baseline: r for r in report.rows if r.baseline}
    assert list(rows) == [RELOAD, WRITE_RELOAD, LOAD_WEIGHTS, RESTART]
    assert all(r.value == refit and r.unit == "s" and r.figure == "other" and r.preset == "FP8_BLOCK"
               for r in rows.values())
    assert rows[RELOAD].baseline_value == 0.3 and rows[RELOAD].ratio == pytest.approx(1.5)
    assert rows[WRITE_RELOAD].baseline_value == pytest.approx(0.40)  # the median of per-round sums
    assert rows[WRITE_RELOAD].ratio == pytest.approx(2.0)
    assert rows[LOAD_WEIGHTS].ratio == pytest.approx(0.5)
    assert rows[RESTART].ratio == pytest.approx(50.0)
    extra = {r.metric: r for r in report.rows if not r.baseline}
    assert extra["write checkpoint (quantize + one safetensors file)"].value == 0.06
    throughput = next(r for r in report.rows if r.metric == "rl-refit refit throughput (BF16 source bytes)")
    assert throughput.value == pytest.approx(2e-3 / refit) and throughput.baseline is None  # no copy_ measured
    bounded = build_report(EngineBenchSettings(), timings(copy_seconds=0.001))
    row = next(r for r in bounded.rows if r.metric == "rl-refit refit throughput (BF16 source bytes)")
    assert row.baseline == COPY and row.baseline_value == pytest.approx(2.0)  # 2 MB in 1 ms
    assert row.ratio == pytest.approx(2e-3 / refit / 2.0)  # the share of the memory bound
    assert all(r.case == "micro-moe FP8_BLOCK colocated bucket 1 MiB" for r in report.rows)


def test_same_bytes_note() -> None:
    notes = build_report(EngineBenchSettings(), timings()).notes
    assert any("exactly the bytes" in n and "other weights" in n for n in notes)
    assert not any("could not be measured" in n for n in notes)


def test_bf16_moe_differing_note_names_the_tensors_and_why() -> None:
    t = timings(same_bytes=False, differing=("layers.1.experts.w13_weight", "layers.1.experts.w2_weight"))
    bf16 = " ".join(build_report(EngineBenchSettings(preset="BF16"), t).notes)
    assert "different bytes" in bf16 and "layers.1.experts.w13_weight, layers.1.experts.w2_weight" in bf16
    assert "expected for BF16 MoE" in bf16 and "docs/engines.md#bf16-moe-on-vllm" in bf16
    fp8 = " ".join(build_report(EngineBenchSettings(preset="FP8_BLOCK"), t).notes)
    assert "different bytes" in fp8 and "expected" not in fp8  # a difference there is a finding


def test_a_reload_that_did_not_move_the_engine_compares_nothing() -> None:
    notes = " ".join(build_report(EngineBenchSettings(), timings(same_bytes=None, moved=False)).notes)
    assert "not compared" in notes and "exactly the bytes" not in notes


def test_unperturbable_trainer_says_so() -> None:
    notes = " ".join(build_report(EngineBenchSettings(), timings(moved=None)).notes)
    assert "from the same weights" in notes


def test_reload_error_is_a_note_and_its_rows_are_absent() -> None:
    t = timings(write=(), reload=(), same_bytes=None, moved=None, reload_error="RuntimeError: no loader")
    report = build_report(EngineBenchSettings(), t)
    assert [r.baseline for r in report.rows if r.baseline] == [LOAD_WEIGHTS, RESTART]
    assert "vLLM's reload_weights could not be measured: RuntimeError: no loader" in report.notes


def test_the_layerwise_floor_is_a_row_and_the_bound_a_note() -> None:
    report = build_report(EngineBenchSettings(), timings(layerwise=(0.15, 0.25, 0.2)))
    row = next(r for r in report.rows if r.baseline == LAYERWISE)
    assert row.value == 0.2 and row.baseline_value == 0.2  # medians: ours 0.2, the floor 0.2
    # reload median 0.3: the refit (0.2) is over half of it, the floor (0.2) too: held to 1.25x the floor
    assert ("bound: met, the refit takes 1.00x vLLM's layerwise reload of the same buckets (at most 1.25x), "
            "which itself takes 0.67x vLLM's reload_weights") in next(n for n in report.notes if n.startswith("bound:"))


def test_speed_target() -> None:
    assert speed_target(1.0, 2.0, 1.9, TERMS).startswith("bound: met, the refit takes 0.50x vLLM's reload_weights")
    assert speed_target(1.0, 1.0, 0.9, TERMS).startswith("bound: met, the refit takes 1.11x vLLM's layerwise")
    assert speed_target(1.2, 1.0, 0.9, TERMS).startswith("bound: NOT met, the refit takes 1.33x vLLM's layerwise")
    # a floor at or under half of reload_weights does not excuse the refit
    assert speed_target(1.0, 1.0, 0.5, TERMS) == ("bound: NOT met, the refit takes 1.00x vLLM's reload_weights (at "
                                                  "most 0.5x; the layerwise floor takes 0.50x vLLM's reload_weights)")
    assert speed_target(1.0, 1.0, None, TERMS) == ("bound: NOT met, the refit takes 1.00x vLLM's reload_weights (at "
                                                   "most 0.5x)")
    assert speed_target(1.0, None, 0.9, TERMS) is None


def test_layerwise_errors_and_differing_bytes_are_notes() -> None:
    report = build_report(EngineBenchSettings(), timings(layerwise_error="KeyError: 'y'", layerwise_same=False))
    assert "the layerwise floor could not be measured: KeyError: 'y'" in report.notes
    assert any(n.startswith("vLLM's layerwise reload of the same buckets left the engine holding other bytes")
               for n in report.notes)
    assert not any(r.baseline == LAYERWISE for r in report.rows)


def test_the_floors_split_the_refit_time() -> None:
    report = build_report(EngineBenchSettings(), timings(layerwise=(0.15, 0.15, 0.15), receive=(0.04, 0.04, 0.04)))
    note = next(n for n in report.notes if n.startswith("where the refit's time goes"))
    # receive 0.04, load_weights median 0.1, layerwise 0.15, refit 0.2
    assert "the buckets made, sent and dropped) 0.040 s" in note
    assert "the unprocessed floor less the transport) 0.060 s" in note
    assert "less the unprocessed one) 0.050 s" in note and "the tied head) 0.050 s" in note
    assert next(r for r in report.rows if r.baseline == RECEIVE).baseline_value == 0.04
    assert not any(n.startswith("where the refit's time goes") for n in build_report(EngineBenchSettings(),
                   timings(layerwise=(0.15,))).notes)  # no transport floor: no split


def test_a_floor_above_the_next_is_no_share() -> None:
    assert "vLLM's processing (the layerwise floor less the unprocessed one) none measurable (-0.100 s)" in (
        time_split(0.3, 0.1, 0.35, 0.25, TERMS) or "")


def test_load_weights_error_is_a_note() -> None:
    t = timings(load_weights=(), load_weights_error="KeyError: 'x'")
    report = build_report(EngineBenchSettings(), t)
    assert LOAD_WEIGHTS not in {r.baseline for r in report.rows}
    assert "the per-bucket load_weights baseline could not be measured: KeyError: 'x'" in report.notes


def test_phases_and_threads_notes() -> None:
    phases = {"export": 0.001, "quantize": 0.02, "pack": 0.001, "load": 0.01, "finalize": 0.03, "verify": 0.002,
              "total": 0.07}
    notes = " ".join(build_report(EngineBenchSettings(), timings(deployment="disaggregated", phases=phases,
                                                                 trainer_threads=1)).notes)
    assert "quantize 20.0" in notes and "finalize 30.0" in notes
    assert "about 6.0 ms: the begin" in notes  # 70 - 64
    assert "1 torch thread," in notes
    assert "torch thread" not in " ".join(build_report(EngineBenchSettings(), timings()).notes)


@pytest.mark.parametrize(("transport", "words"), [("shm", "shared-memory ring"), ("gloo", "side group's stream")])
def test_the_notes_say_which_transport_the_buckets_took(transport: str, words: str) -> None:
    phases = {"load": 0.01, "finalize": 0.03, "total": 0.05}
    notes = " ".join(build_report(EngineBenchSettings(), timings(deployment="disaggregated", phases=phases,
                                                                 transport=transport)).notes)
    assert f"through the {words}" in notes and f"transport={transport}" in notes
    assert f"load: each bucket into the {words}" in notes
    assert "transport=" not in " ".join(build_report(EngineBenchSettings(), timings()).notes)


def test_rows_fit_the_other_figure_and_the_markdown_report() -> None:
    report = build_report(EngineBenchSettings(), timings())
    other = group_rows({"engine": report.rows})
    assert list(other) == ["other"] and len(other["other"]) == 4
    result = AllResult(True, report.machine, [SuiteResult("engine", "ok", 1.0, report=report)], 1.0)
    text = markdown(result)
    assert "## engine" in text and "vLLM reload_weights from disk" in text and "1.50x" in text


def test_rows_draw(tmp_path) -> None:
    pytest.importorskip("matplotlib", reason="the figures are drawn with matplotlib")
    from app.bench.figures import draw

    report = build_report(EngineBenchSettings(), timings())
    path = draw("other", group_rows({"engine": report.rows})["other"], report.machine, tmp_path / "other.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- rounds ----------------------------------------------------------------------------------


def test_rounds_warm_up_then_alternate_the_order() -> None:
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("refit", "write", "reload")}
    times = engine._rounds(fns, 3)
    assert calls == ["refit", "write", "reload",  # warm-up, not timed
                     "refit", "write", "reload", "reload", "write", "refit", "refit", "write", "reload"]
    assert {k: len(v) for k, v in times.items()} == {"refit": 3, "write": 3, "reload": 3}
    assert all(t >= 0 for v in times.values() for t in v)


def test_median_phases() -> None:
    got = engine._median_phases([{"load": 1.0, "total": 3.0}, {"load": 5.0, "total": 4.0}, {"load": 2.0}])
    assert got == {"load": 2.0, "total": 3.0}  # a phase missing from a refit counts 0
    assert engine._median_phases([]) == {}


def test_rounds_call_enter_and_leave_untimed_around_their_path() -> None:
    calls: list[str] = []
    fns = {"refit": lambda: calls.append("refit"), "load_weights": lambda: calls.append("load")}
    around = {"load_weights": (lambda: calls.append("enter"), lambda: calls.append("leave"))}
    engine._rounds(fns, 2, around)
    assert calls == ["refit", "enter", "load", "leave",  # warm-up
                     "refit", "enter", "load", "leave", "enter", "load", "leave", "refit"]


def test_rounds_leave_when_the_call_raises() -> None:
    calls: list[str] = []

    def fail() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        engine._rounds({"load_weights": fail}, 1, {"load_weights": (lambda: calls.append("enter"),
                                                                     lambda: calls.append("leave"))})
    assert calls == ["enter", "leave"]


def test_attempt_reports_a_failure_and_always_leaves() -> None:
    calls: list[str] = []

    def fail() -> None:
        raise KeyError("w13_weight")

    assert engine._attempt(fail, lambda: calls.append("enter"), lambda: calls.append("leave")) == \
        "KeyError: 'w13_weight'"
    assert engine._attempt(lambda: calls.append("ok")) is None
    assert calls == ["enter", "leave", "ok"]


def test_a_failed_put_back_is_a_note() -> None:
    assert not any("did NOT hold" in n for n in build_report(EngineBenchSettings(), timings()).notes)
    notes = build_report(EngineBenchSettings(), timings(put_back=False)).notes
    assert any("did NOT hold its bytes" in n and "suspect" in n for n in notes)


def test_the_engine_hosts_python_comes_from_the_composition_root() -> None:
    from app.bootstrap import bootstrap

    assert bootstrap(environ={"RL_REFIT_VLLM_PYTHON": "/env/python"}).engines.server_python("vllm") == "/env/python"
    configured = bootstrap(overrides=["rollout.engine_kwargs.vllm.python=/cfg/python"],
                           environ={"RL_REFIT_VLLM_PYTHON": "/env/python"})
    assert configured.engines.server_python("vllm") == "/cfg/python"  # the configuration wins over the environment


def test_memory_rows_compare_each_side_with_its_bound() -> None:
    settings = EngineBenchSettings(bucket_mb=512.0)
    t = timings(deployment="disaggregated", source_bytes=1500 * 2**20, bucket_bytes=512 * 2**20,
                trainer_peak_bytes=700 * 2**20, engine_peak_bytes=30 * 2**20)
    rows = {r.metric: r for r in build_report(settings, t).rows}
    trainer = rows["trainer process: peak RSS during a refit above its RSS before"]
    assert (trainer.value, trainer.baseline_value) == (700.0, 1024.0) and trainer.ratio == pytest.approx(1024 / 700)
    engine_row = rows["engine processes: peak RSS growth during a refit (sum over processes)"]
    assert (engine_row.value, engine_row.baseline_value) == (30.0, 1500.0) and engine_row.ratio == pytest.approx(50.0)
    colocated = build_report(settings, timings(deployment="colocated", source_bytes=1, bucket_bytes=2**20,
                                               trainer_peak_bytes=0))
    metrics = {r.metric for r in colocated.rows}
    assert "engine processes: peak RSS growth during a refit (sum over processes)" not in metrics
    assert any("its row is the trainer's" in n for n in colocated.notes)


# --- a quantized preset against the same model in BF16 -------------------------------------------


def test_quantized_rows_put_the_refit_and_its_quantize_phase_next_to_the_bf16_refit() -> None:
    codec = {"path": "compiled", "reason": "bit-identical", "warmup_seconds": 12.0, "eager_seconds": 1.0,
             "compiled_seconds": 0.3}
    t = timings(phases={"export": 0.01, "quantize": 0.08, "pack": 0.01}, bf16_refit=(0.1, 0.2, 0.4),
                bf16_phases={"export": 0.01, "pack": 0.02}, codec=codec)
    report = build_report(EngineBenchSettings(preset="FP8_BLOCK"), t)
    rows = {(r.metric, r.baseline): r for r in report.rows}
    refit = rows[("refit time", engine.BF16_REFIT)]
    assert refit.value == statistics.median(REFIT) and refit.baseline_value == 0.2
    assert rows[("quantize phase of the refit", engine.BF16_REFIT)].value == 0.08
    assert any(n.startswith("bound: met, the FP8_BLOCK refit takes 1.00x the BF16 refit") for n in report.notes)
    assert any(n.startswith("codec path: compiled (bit-identical)") for n in report.notes)
    slow = build_report(EngineBenchSettings(preset="FP8_BLOCK"), timings(bf16_refit=(0.1,)))
    assert any(n.startswith("bound: NOT met, the FP8_BLOCK refit takes 2.00x") for n in slow.notes)
    failed = build_report(EngineBenchSettings(preset="FP8_BLOCK"), timings(bf16_error="ValueError: no engine"))
    assert not any(r.baseline == engine.BF16_REFIT for r in failed.rows)
    assert "the BF16 refit of the same model could not be measured: ValueError: no engine" in failed.notes


class _PackedBench:
    """What _move_away sees of a bench: a trainer that can be perturbed, refits, and the engine's
    digests, where `packed` parameters are UNREADABLE (vLLM's CPU BF16 Linear layers)."""

    def __init__(self, packed: set[str], moves: set[str]) -> None:
        self.packed, self.moves, self.refits = packed, moves, 0
        self.svc = self
        self.trainer = self

    def snapshot(self) -> object:
        return object()

    def perturb_(self, seed: int, scale: float) -> None:
        pass

    def restore_(self, kept: object) -> None:
        pass

    def refit(self) -> None:
        self.refits += 1

    def digests(self) -> dict[str, str]:
        from domain.refit.storage import UNREADABLE

        return {n: UNREADABLE if n in self.packed else f"{n}@{self.refits if n in self.moves else 0}"
                for n in ("proj.weight", "norm.weight")}


def test_packed_weights_that_did_not_move_are_not_taken_for_the_engines_bytes() -> None:
    everything = _PackedBench({"proj.weight", "norm.weight"}, set())
    assert engine._move_away(everything, everything.digests()) is None  # nothing readable: not "unchanged"
    stuck = _PackedBench({"proj.weight"}, set())
    assert engine._move_away(stuck, stuck.digests()) is False  # the readable norm did not move
    moving = _PackedBench({"proj.weight"}, {"norm.weight"})
    assert engine._move_away(moving, moving.digests()) is True


def test_unreadable_parameters_are_a_note_and_the_same_bytes_note_says_what_it_covers() -> None:
    t = timings(unreadable=("layers.0.qkv.weight", "layers.0.o.weight", "layers.1.qkv.weight", "layers.1.o.weight"))
    notes = " ".join(build_report(EngineBenchSettings(), t).notes)
    assert "4 parameters were not compared byte for byte" in notes and "layers.0.qkv.weight" in notes
    assert "every parameter and buffer it could read" in notes
    assert "not compared" not in " ".join(build_report(EngineBenchSettings(), timings()).notes)


def test_a_put_back_with_nothing_readable_is_not_called_a_failure() -> None:
    notes = build_report(EngineBenchSettings(), timings(put_back=None, unreadable=("w",))).notes
    assert not any("did NOT hold" in n for n in notes)
