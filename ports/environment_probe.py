"""Port: what the machine has installed and which GPUs it sees (`refit doctor`)."""

from __future__ import annotations

from typing import Protocol

from domain.environment import EnvironmentSnapshot


class EnvironmentProbe(Protocol):
    """Inspects the machine without importing optional heavy packages.

    Implementations: `adapters.system.probe.SystemProbe` (this machine) and
    `adapters.memory.environment.FixedEnvironmentProbe` (a snapshot given in advance).
    """

    def snapshot(self) -> EnvironmentSnapshot:
        """Take the snapshot.

        Returns:
            The Python version, installed package versions, torch's CUDA build, visible GPUs,
            NCCL availability and the honoured environment variables.
        """
        ...
