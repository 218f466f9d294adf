"""SystemProbe: the EnvironmentProbe of this machine.

Package versions come from installed metadata (`importlib.metadata`), so optional packages
(transformer-engine, vLLM, SGLang, ...) are never imported: a half-installed one cannot crash
the probe. torch, a core dependency, is asked for its CUDA build and the visible GPUs.
"""

from __future__ import annotations

import importlib.metadata
import platform
from collections.abc import Callable, Mapping

import attrs

from domain.environment import DISTRIBUTIONS, EnvironmentSnapshot, GpuInfo


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
    """

    environ: Mapping[str, str] = attrs.field(factory=dict)
    version_of: Callable[[tuple[str, ...]], str | None] = installed_version

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
        )
