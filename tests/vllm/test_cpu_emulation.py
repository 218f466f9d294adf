"""The CPU emulation plugin inside real vLLM (the CPU build): vLLM finds it as a general plugin,
it adds its kernels to vLLM's own per-platform tables (after vLLM's), and it changes nothing on a
platform that is not the CPU or when configured off. Each case runs in a process of its own: the
registration changes vLLM's module state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (.venv-vllm), which `make test` creates")

ROOT = Path(__file__).resolve().parents[2]

# Prints the CPU platform's kernel class names of each table the plugin may extend, after calling
# `register` (the `vllm.general_plugins` entry point) under the given platform stand-in.
SCRIPT = """
import json, sys
from importlib.metadata import entry_points
import vllm.model_executor.kernels.linear as linear
from vllm.platforms import PlatformEnum, current_platform
from adapters.vllm.cpu_emulation import FORMATS
plugin = [e for e in entry_points(group="vllm.general_plugins") if e.name == "rl_refit_cpu_emulation"]
if sys.argv[1] == "cuda":
    type(current_platform).is_cpu = lambda self: False  # a GPU platform, as far as the plugin can tell
plugin[0].load()()
print(json.dumps({"plugin": [e.value for e in plugin],
                  "tables": {f.name: [k.__name__ for k in getattr(linear, f.registry).get(PlatformEnum.CPU, [])]
                             for f in FORMATS}}))
"""
OURS = {"FP8_BLOCK": "TorchFp8BlockScaledMMKernel", "MXFP8": "EmulationMxfp8LinearKernel",
        "MXFP4": "EmulationMxfp4LinearKernel", "NVFP4": "EmulationNvFp4LinearKernel"}


def _tables(platform: str, mode: str) -> dict[str, object]:
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "RL_REFIT_VLLM_CPU_EMULATION": mode}
    done = subprocess.run([sys.executable, "-c", SCRIPT, platform], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def _status(mode: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-m", "adapters.vllm.cpu_emulation", mode], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_vllm_finds_the_plugin_and_auto_adds_a_kernel_for_each_format_this_cpu_has_none_for() -> None:
    status = _status("auto")
    found = _tables("cpu", "auto")
    assert found["plugin"] == ["adapters.vllm.plugin:register"]
    tables = found["tables"]
    assert isinstance(tables, dict)
    for fmt, kernel in OURS.items():
        native = status["native"][fmt]  # type: ignore[index]
        assert (kernel in tables[fmt]) == (native is not None), (fmt, native, tables[fmt])
        if kernel in tables[fmt]:
            assert tables[fmt][-1] == kernel  # after vLLM's own: a native kernel that can is still chosen


def test_on_adds_every_kernel() -> None:
    tables = _tables("cpu", "on")["tables"]
    assert isinstance(tables, dict)
    assert all(kernel in tables[fmt] for fmt, kernel in OURS.items())


@pytest.mark.parametrize(("platform", "mode"), [("cpu", "off"), ("cuda", "auto"), ("cuda", "on")])
def test_nothing_changes_when_off_or_on_another_platform(platform: str, mode: str) -> None:
    tables = _tables(platform, mode)["tables"]
    assert isinstance(tables, dict)
    assert not any(kernel in tables[fmt] for fmt, kernel in OURS.items()), tables
