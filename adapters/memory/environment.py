"""FixedEnvironmentProbe: an EnvironmentProbe that returns a snapshot given in advance.

For tests (fake machines: no GPU, old versions, missing packages) and for judging a machine
described elsewhere (a snapshot saved with `refit doctor --json` on that machine).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from domain.environment import EnvironmentSnapshot, GpuInfo


@attrs.define
class FixedEnvironmentProbe:
    """Returns `snapshot_value` every time."""

    snapshot_value: EnvironmentSnapshot

    def snapshot(self) -> EnvironmentSnapshot:
        return self.snapshot_value

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FixedEnvironmentProbe:
        """From the `environment` object of `refit doctor --json` (EnvironmentSnapshot.to_dict)."""
        return cls(EnvironmentSnapshot(
            python=str(data["python"]),
            packages=data.get("packages", {}),
            torch_cuda=data.get("torch_cuda"),
            gpus=[GpuInfo(g["name"], g["capability"]) for g in data.get("gpus", ())],
            nccl=bool(data.get("nccl", False)),
            environ=data.get("environ", {}),
            platform=str(data.get("platform", "")),
            # snapshots saved before the field was named for every engine call it vllm_cpu_kernels
            engine_cpu_kernels=data.get("engine_cpu_kernels", data.get("vllm_cpu_kernels")),
        ))
