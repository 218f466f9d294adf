"""Contract of the EnvironmentProbe port, run against this machine's probe and a snapshot probe.

Every probe returns an EnvironmentSnapshot that knows the Python version, a version (or None) for
every distribution `refit doctor` reports, the honoured environment variables it was given, and
GPUs consistent with torch's CUDA build; a snapshot survives `to_dict` and
`FixedEnvironmentProbe.from_dict` unchanged (what `refit doctor --environment FILE` reads).
"""

from __future__ import annotations

import json
import platform

import pytest

from adapters.memory.environment import FixedEnvironmentProbe
from adapters.profiles import DISTRIBUTIONS
from adapters.system.probe import SystemProbe
from domain.environment import EnvironmentSnapshot, GpuInfo

ENVIRON = {"VERL_FUSED_USE_OP_HOOK": "1"}
PROBES = ("system", "fixed-gpu-machine", "fixed-from-this-machine")


def _probe(kind: str):  # type: ignore[no-untyped-def]
    if kind == "system":
        return SystemProbe(environ=ENVIRON)
    if kind == "fixed-gpu-machine":
        packages = dict.fromkeys(DISTRIBUTIONS) | {"torch": "2.14.0", "vllm": "0.33.0"}
        return FixedEnvironmentProbe(EnvironmentSnapshot(
            python="3.12.3", packages=packages, torch_cuda="12.8", gpus=(GpuInfo("NVIDIA H200", (9, 0)),) * 2,
            nccl=True, environ=ENVIRON, platform="Linux"))
    data = json.loads(json.dumps(SystemProbe(environ=ENVIRON).snapshot().to_dict()))  # as saved to a file
    return FixedEnvironmentProbe.from_dict(data)


@pytest.fixture(params=PROBES)
def probe(request):  # type: ignore[no-untyped-def]
    return _probe(request.param)


def test_snapshot_covers_python_every_distribution_and_the_environment(probe) -> None:
    snap = probe.snapshot()
    assert isinstance(snap, EnvironmentSnapshot)
    assert snap.python.count(".") >= 1 and snap.python.split(".")[0] == "3"
    assert set(snap.packages) == set(DISTRIBUTIONS)
    assert snap.version("torch") is not None
    assert dict(snap.environ) == ENVIRON


def test_gpus_agree_with_the_cuda_build(probe) -> None:
    snap = probe.snapshot()
    if snap.gpus:
        assert snap.torch_cuda is not None and snap.capability == min(g.capability for g in snap.gpus)
    else:
        assert snap.capability is None


def test_snapshot_round_trips_through_its_saved_form(probe) -> None:
    snap = probe.snapshot()
    again = FixedEnvironmentProbe.from_dict(json.loads(json.dumps(snap.to_dict()))).snapshot()
    assert again == snap


def test_the_system_probe_reads_this_machine() -> None:
    snap = SystemProbe().snapshot()
    import torch

    assert snap.python == platform.python_version()
    assert snap.version("torch") == torch.__version__
    assert snap.torch_cuda == torch.version.cuda
