"""`refit bench engine --device`: refits into the embedded engine on a device, against a copy_ of
the same bytes on that device measured in the same run."""

from __future__ import annotations

import json

import pytest
import torch

from app.bench.engine_device import COPY_D2D, DeviceBenchSettings, run
from domain.errors import ConfigError


def test_the_engine_bench_on_the_cpu_reports_the_copy_bound():
    report = run(DeviceBenchSettings("cpu", repeat=1))
    (row,) = report.rows
    assert row.unit == "GB/s" and row.value > 0
    assert row.baseline == COPY_D2D and row.baseline_value is not None and row.baseline_value > 0
    assert any("captured storage kept on every refit: True" in n for n in report.notes)
    assert any(n.startswith("where the time goes") for n in report.notes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_gpu_that_is_not_there_is_refused_with_the_flag():
    with pytest.raises(ConfigError, match="--device"):
        DeviceBenchSettings("cuda")


def test_presets_and_flags_are_checked():
    with pytest.raises(ConfigError, match="--preset"):
        DeviceBenchSettings("cpu", preset="INT4")
    with pytest.raises(ConfigError, match="--device"):
        DeviceBenchSettings("meta")


def test_the_cli_runs_the_device_bench(capsys):
    from app.cli.main import main

    assert main(["bench", "engine", "--device", "cpu", "--quick", "--repeat", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"][0]["baseline"] == COPY_D2D
    assert main(["bench", "refit", "--device", "cpu"]) != 0
    assert "--device goes with the engine and codecs suites" in capsys.readouterr().err
