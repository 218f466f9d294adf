"""`refit bench all`: tiny fake suites through the aggregator; JSON, Markdown and PNG outputs."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="refit bench all draws its figures with matplotlib")

import app.bench
from app.bench import figures
from app.bench.all import JSON_NAME, REPORT_NAME, run_all, suite_names
from app.bench.report import BenchReport, BenchRow
from app.cli.main import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def codecs_like(quick: bool) -> BenchReport:
    r = BenchReport("codecs")
    scale = 1 if quick else 2
    r.add("NVFP4 64x64", "quantize", 3.0 * scale, "GB/s", "compressed-tensors", 1.5)
    r.add("MXFP8 64x64", "quantize", 2.0, "GB/s", "torchao", 4.0)
    r.add("64x64", "copy_", 9.0, "GB/s")  # no baseline: tables only
    r.notes.append("fake codecs note")
    return r


def logprobs_like(quick: bool) -> BenchReport:
    r = BenchReport("logprobs")
    r.add("T=256 V=1024", "peak memory", 2.0, "MiB", "plain logits", 16.0)
    r.add("NVFP4 arm", "k3 KL", 1e-4, "nats", "BF16 arm", 1e-6)
    r.add("FP8_BLOCK arm", "k3 KL", 5e-5, "nats", "BF16 arm", 1e-6)
    return r


def refit_like(quick: bool) -> BenchReport:
    r = BenchReport("refit")
    for mib in (1, 4, 16):
        r.add(f"bucket {mib} MiB", "refit throughput", 100.0 * mib, "MiB/s", "single copy", 400.0, x=mib)
        r.add(f"bucket {mib} MiB", "peak memory", 2.0 * mib, "MiB", "whole model", 64.0, figure="bucket")
    r.add("odd", "latency", 2.0, "s", "other way", 3.0, figure="no-such-figure")
    return r


def broken(quick: bool) -> BenchReport:
    raise RuntimeError("suite exploded")


def needs_vllm(quick: bool) -> BenchReport:
    raise ModuleNotFoundError("the fake suite needs vllm", name="vllm")


def needs_own_module(quick: bool) -> BenchReport:
    raise ModuleNotFoundError("No module named 'app.bench.gone'", name="app.bench.gone")


def must_not_run(quick: bool) -> BenchReport:
    raise AssertionError("`all` must not run itself")


SUITES = {
    "codecs": codecs_like, "logprobs": logprobs_like, "refit": refit_like, "broken": broken,
    "vllm-only": needs_vllm, "typo": needs_own_module, "all": must_not_run,
}


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("bench")
    return run_all(SUITES, quick=True, out_dir=out), out


def test_every_suite_but_all_runs_in_order(result) -> None:
    res, _ = result
    assert [s.name for s in res.suites] == ["codecs", "logprobs", "refit", "broken", "vllm-only", "typo"]
    assert suite_names({"a": "x", "all": "y", "b": "z"}) == ["a", "b"]


def test_statuses(result) -> None:
    res, _ = result
    status = {s.name: s.status for s in res.suites}
    assert status == {"codecs": "ok", "logprobs": "ok", "refit": "ok", "broken": "error",
                      "vllm-only": "skipped", "typo": "error"}
    assert "suite exploded" in next(s.error for s in res.suites if s.name == "broken")
    assert not res.ok


def test_json_holds_every_row_with_its_ratio(result) -> None:
    _, out = result
    data = json.loads((out / JSON_NAME).read_text())
    assert data["quick"] is True
    assert {"cpu_count", "memory_gib", "torch", "load_average_before", "load_average_after"} <= set(data["machine"])
    assert set(data["suites"]) == {"codecs", "logprobs", "refit", "broken", "vllm-only", "typo"}
    for name, fn in (("codecs", codecs_like), ("logprobs", logprobs_like), ("refit", refit_like)):
        expected = fn(True).rows
        got = data["suites"][name]["rows"]
        assert [(r["case"], r["metric"], r["value"]) for r in got] == [(r.case, r.metric, r.value) for r in expected]
        for r in got:
            if r["baseline_value"] is None:
                assert r["ratio"] is None
            elif r["unit"].endswith("/s"):
                assert r["ratio"] == pytest.approx(r["value"] / r["baseline_value"])
            else:
                assert r["ratio"] == pytest.approx(r["baseline_value"] / r["value"])
    assert data["suites"]["codecs"]["notes"] == ["fake codecs note"]
    assert data["suites"]["broken"]["status"] == "error" and "rows" not in data["suites"]["broken"]


def test_figures_are_png_files_with_pixels(result) -> None:
    import matplotlib.image

    res, out = result
    assert set(res.figures) == {"throughput", "memory", "bucket", "mismatch", "other"}
    for key, path in res.figures.items():
        assert path == out / f"bench-{key}.png"
        assert path.read_bytes()[:8] == PNG_MAGIC
        img = matplotlib.image.imread(path)
        assert img.shape[0] > 100 and img.shape[1] > 100
        assert img[..., :3].std() > 0  # not a blank canvas


def test_markdown_report(result) -> None:
    res, out = result
    md = (out / REPORT_NAME).read_text()
    assert md.startswith("# rl-refit benchmark report")
    assert figures.machine_line(res.machine) in md
    assert "| NVFP4 64x64 | quantize | 3 GB/s | compressed-tensors (1.5 GB/s) | 2.00x |" in md
    assert "| T=256 V=1024 | peak memory | 2 MiB | plain logits (16 MiB) | 8.00x |" in md
    assert "| 64x64 | copy_ | 9 GB/s | - | - |" in md
    assert "| broken | error: RuntimeError: suite exploded |" in md
    for key in res.figures:
        link = f"(bench-{key}.png)"
        assert link in md and (out / link[1:-1]).exists()


def test_classification() -> None:
    row = BenchRow("bucket 64 MiB", "refit throughput", 1.0, "GB/s", "copy", 2.0)
    assert figures.classify("refit", row) == "throughput"  # a size in the name alone is not a sweep
    assert figures.classify("refit", BenchRow("c", "refit throughput", 1.0, "GB/s", "copy", 2.0, x=8)) == "bucket"
    assert figures.bucket_mib(row) == 64
    assert figures.bucket_mib(BenchRow("bucket 512 KiB", "m", 1.0, "s")) == 0.5
    assert figures.bucket_mib(BenchRow("c", "m", 1.0, "s", x=3.0)) == 3.0
    assert figures.classify("codecs", BenchRow("c", "m", 1.0, "GB/s")) is None  # no baseline, no figure
    assert figures.classify("x", BenchRow("c", "m", 1.0, "s", "b", 2.0, figure="mismatch")) == "mismatch"
    assert figures.classify("logprobs", BenchRow("c", "peak", 1.0, "B", "plain", 4.0)) == "memory"
    assert figures.preset_of(BenchRow("MXFP4 1024x1024", "m", 1.0, "s")) == "MXFP4"
    assert figures.preset_of(BenchRow("MXFP4", "m", 1.0, "s", preset="NVFP4")) == "NVFP4"


@pytest.fixture()
def logs(monkeypatch: pytest.MonkeyPatch):
    # The CLI configures structlog once per process, bound to the stderr of that moment; keep the
    # configuration as it is and capture the events instead (pytest swaps stderr per test).
    import structlog

    import app.logging

    monkeypatch.setattr(app.logging, "_configured", True)
    with structlog.testing.capture_logs() as captured:
        yield captured


@pytest.fixture()
def fake_suite_module(monkeypatch: pytest.MonkeyPatch, logs):
    mod = types.ModuleType("fake_bench_suite")
    mod.run = codecs_like  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_bench_suite", mod)
    monkeypatch.setattr(app.bench, "SUITES", {"fake": "fake_bench_suite"})
    return mod


def test_cli_json_and_files(fake_suite_module, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "all", "--quick", "--out", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data["suites"]) == ["fake"]
    assert data["suites"]["fake"]["rows"][0]["value"] == 3.0  # quick=True reached the suite
    assert (tmp_path / JSON_NAME).exists() and (tmp_path / "bench-throughput.png").exists()


def test_cli_exits_1_when_a_suite_fails(fake_suite_module, logs, tmp_path: Path) -> None:
    fake_suite_module.run = broken
    assert main(["bench", "all", "--out", str(tmp_path)]) == 1
    assert json.loads((tmp_path / JSON_NAME).read_text())["suites"]["fake"]["status"] == "error"
    assert [e["suite"] for e in logs if e["event"] == "bench_suite_failed"] == ["fake"]


@pytest.mark.parametrize("where", ["below a file", "read-only"])
def test_cli_refuses_an_out_it_cannot_write_before_any_suite_runs(where: str, fake_suite_module, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    ran: list[bool] = []
    fake_suite_module.run = lambda quick: ran.append(quick) or codecs_like(quick)
    if where == "below a file":
        (tmp_path / "file").write_text("x")
        out = tmp_path / "file" / "bench"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only directories")
        out = tmp_path / "ro"
        out.mkdir()
        out.chmod(0o500)
    assert main(["bench", "all", "--quick", "--out", str(out)]) == 2  # before: the suites ran, then exit 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "OutputNotWritable" in err and str(out) in err and "choose another --out" in err
    assert ran == []


def test_measure_interleaved_runs_the_candidates_in_turns() -> None:
    from app.bench.report import measure_interleaved

    calls: list[str] = []
    medians = measure_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeat=3)
    assert set(medians) == {"a", "b"} and all(m >= 0 for m in medians.values())
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-ups, then turns in alternating order
