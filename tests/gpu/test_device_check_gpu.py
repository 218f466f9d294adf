"""pytest wrapper of device_check.py on a CUDA device: every phase passes its checks (the figures
against the targets are in the JSON file it writes; docs/benchmarks.md)."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_the_device_check_passes_on_this_gpu(tmp_path) -> None:
    from tests.gpu.device_check import main

    out = tmp_path / "device_check.json"
    rc = main(["--out", str(out)])
    phases = json.loads(out.read_text())["phases"]
    failed = {name: p.get("error", p) for name, p in phases.items() if p.get("passed") is False}
    assert rc == 0 and not failed, json.dumps(failed, indent=1, default=str)[-4000:]
