"""`refit bench engine --model DIR` and `refit bench export --model DIR`: a checkpoint directory in
place of the embedded presets, what each suite takes from the command line, and what it refuses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.cli.main import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from adapters.hf.fixtures import write_fixture

    return write_fixture("tiny-qwen3", tmp_path_factory.mktemp("ckpt") / "tiny", max_shard_size="200KB")


def test_export_exports_the_directory_and_reports_the_shard_bound(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "export", "--model", str(tiny), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["metric"]: r for r in report["rows"]}
    assert all(r["case"].startswith("tiny ") for r in report["rows"])  # the directory, not a built checkpoint
    bound = rows["peak RSS above imports vs 1.1 x largest shard + its output"]
    shards = sorted(f.stat().st_size for f in tiny.glob("*.safetensors"))
    assert len(shards) > 1  # several shards: the bound names the largest
    assert bound["baseline_value"] >= 1.1 * shards[-1] / 2**20
    assert bound["value"] == rows["peak RSS above imports"]["value"]
    assert any("largest source shard" in n for n in report["notes"])


def test_engine_takes_the_directory_and_the_engine_options(tiny: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    import app.bench.engine as engine_bench
    from app.bench.report import BenchReport

    seen: dict[str, Any] = {}

    def fake_run(quick: bool = False, settings: Any = None) -> BenchReport:
        seen["settings"] = settings
        return BenchReport("engine")

    monkeypatch.setattr(engine_bench, "run", fake_run)
    assert main(["bench", "engine", "--model", str(tiny), "--deployment", "disaggregated", "--preset", "BF16",
                 "--repeat", "2", "--json"]) == 0
    s = seen["settings"]
    assert (s.model, s.deployment, s.preset, s.repeat, s.bucket_mb) == (str(tiny), "disaggregated", "BF16", 2, 512.0)
    assert main(["bench", "engine", "--quick", "--json"]) == 0
    assert seen["settings"].model == "micro-moe"  # the embedded presets stay the default
    capsys.readouterr()


@pytest.mark.parametrize(("argv", "match"), [
    (["bench", "export", "--preset", "BF16"], "--preset goes with refit bench engine"),
    (["bench", "engine", "--model", "/nonexistent/dir"], "no such directory"),
    (["bench", "codecs", "--model", "/x"], "--model"),
])
def test_what_the_suites_refuse(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert match in capsys.readouterr().err
