"""SystemProbe: the EnvironmentProbe of this machine.

Package versions come from installed metadata (`importlib.metadata`), so optional packages
(transformer-engine, vLLM, SGLang, ...) are never imported: a half-installed one cannot crash
the probe. torch, a core dependency, is asked for its CUDA build and the visible GPUs.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from adapters.profiles import DISTRIBUTIONS
from domain.environment import EnvironmentSnapshot, GpuInfo


def installed_version(candidates: tuple[str, ...]) -> str | None:
    """The version of the first installed distribution among `candidates`, or None."""
    for name in candidates:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _torch_facts() -> tuple[str | None, tuple[GpuInfo, ...], bool]:
    try:
        import torch
    except ImportError:
        return None, (), False
    gpus: tuple[GpuInfo, ...] = ()
    if torch.cuda.is_available():
        gpus = tuple(
            GpuInfo(torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
            for i in range(torch.cuda.device_count())
        )
    nccl = bool(torch.distributed.is_available() and torch.distributed.is_nccl_available())
    return torch.version.cuda, gpus, nccl


@attrs.define
class SystemProbe:
    """Probes this machine.

    Attributes:
        environ: the honoured environment variables, read by the composition root.
        version_of: looks up one distribution's version (a seam for tests of this adapter).
        vllm_python: the interpreter of the vLLM environment, whose CPU kernels are asked for
            (None: not asked).
        cpu_emulation: the CPU emulation mode that environment is asked about.
        notify: told what the probe waits for before a step that takes seconds (asking the vLLM
            environment starts an interpreter that imports vLLM); None: nothing is said.
    """

    environ: Mapping[str, str] = attrs.field(factory=dict)
    version_of: Callable[[tuple[str, ...]], str | None] = installed_version
    vllm_python: str | None = None
    cpu_emulation: str = "auto"
    notify: Callable[[str], None] | None = None

    def snapshot(self) -> EnvironmentSnapshot:
        torch_cuda, gpus, nccl = _torch_facts()
        return EnvironmentSnapshot(
            python=platform.python_version(),
            packages={key: self.version_of(names) for key, names in DISTRIBUTIONS.items()},
            torch_cuda=torch_cuda,
            gpus=gpus,
            nccl=nccl,
            environ=self.environ,
            platform=platform.platform(),
            engine_cpu_kernels=vllm_cpu_kernels(self.vllm_python, self.cpu_emulation, self.notify) if not gpus else None,
        )


VLLM_PROBE_TIMEOUT_S = 180.0


# How `refit doctor` names what the probe below asked (beside its findings, in every answer).
VLLM_KERNEL_LABELS = {"engine": "vLLM", "setup": "make test creates .venv-vllm (scripts/setup-vllm-env.sh)",
                      "emulation": "rollout.engine_kwargs.vllm.cpu_emulation=auto"}


def vllm_cpu_kernels(python: str | None, mode: str,
                     notify: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """What the vLLM adapter's CPU emulation plugin reports in the vLLM environment of `python`
    (`python -m adapters.vllm.cpu_emulation MODE`: vLLM's native CPU kernels, the emulated
    formats), with VLLM_KERNEL_LABELS, or None when there is no such interpreter. A probe that
    fails says why, as `{"error": ...}`. `notify` is told first: the interpreter imports vLLM,
    which takes seconds."""
    if python is None or not Path(python).is_file():
        return None
    if notify is not None:
        notify(f"asking {python} for vLLM's CPU kernels (it imports vLLM, which takes seconds) ...")
    try:
        done = subprocess.run([python, "-m", "adapters.vllm.cpu_emulation", mode], capture_output=True, text=True,
                              timeout=VLLM_PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as err:
        return {**VLLM_KERNEL_LABELS, "error": f"{python} -m adapters.vllm.cpu_emulation: {err}"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {**VLLM_KERNEL_LABELS, "error": f"{python} -m adapters.vllm.cpu_emulation exited {done.returncode}: {last}"}
    result: dict[str, Any] = {**VLLM_KERNEL_LABELS, **json.loads(lines[-1])}
    return result
