"""Which transport carries a refit's buckets from the trainer to an engine's workers in other
processes, decided from where the tensors and the receivers live (docs/engines.md, "Transports").

- `shm`: a shared-memory ring on one host; the bytes cross the host (a GPU trainer packs them into
  pinned host memory).
- `gloo`: a process group over TCP, any hosts; host tensors.
- `nccl`: a process group over NCCL, any hosts; GPU tensors on both ends.
- `cuda_ipc`: a double buffer on the trainer's GPU that the workers on the same host map once
  (CUDA IPC handles); GPU tensors on both ends, one host.
- `auto`: the fastest that applies: cuda_ipc on one host with GPUs on both ends, nccl across hosts
  with GPUs on both ends, else shm on one host, else gloo.
"""

from __future__ import annotations

import attrs

from domain.errors import ConfigError

TRANSPORTS = ("shm", "gloo", "nccl", "cuda_ipc")
CHOICES = (*TRANSPORTS, "auto")


@attrs.frozen
class TransportChoice:
    """A transport and why.

    Attributes:
        name: one of TRANSPORTS.
        reason: one line: what made it the choice.
    """

    name: str
    reason: str


def choose_transport(requested: str, *, source_device: str, receiver_device: str, same_host: bool,
                     config_key: str = "transport") -> TransportChoice:
    """The transport for a stream, checked against where its ends live.

    Args:
        requested: one of CHOICES (the configuration's value).
        source_device: the device type of the trainer's tensors ("cpu", "cuda").
        receiver_device: the device type of the engine workers' weights.
        same_host: the workers run on the trainer's host.
        config_key: the configuration key the value came from (named in errors; each engine has its own).

    Returns:
        The TransportChoice. Raises ConfigError naming the key when the value is unknown, or when
        the requested transport cannot reach these ends (and says which one can).
    """
    if requested not in CHOICES:
        raise ConfigError(config_key, f"unknown transport {requested!r}; use one of {', '.join(CHOICES)}")
    gpus = source_device == "cuda" and receiver_device == "cuda"
    where = (f"trainer on {source_device}, workers on {receiver_device}, "
             f"{'one host' if same_host else 'other hosts'}")
    if requested == "auto":
        name = ("cuda_ipc" if same_host else "nccl") if gpus else "shm" if same_host else "gloo"
        return TransportChoice(name, f"auto: {where}")
    best = choose_transport("auto", source_device=source_device, receiver_device=receiver_device, same_host=same_host)
    if requested in ("nccl", "cuda_ipc") and not gpus:
        raise ConfigError(config_key, f"{requested} moves GPU tensors on both ends, but here the {where}; "
                          f"use {best.name} (or auto)")
    if requested in ("shm", "cuda_ipc") and not same_host:
        raise ConfigError(config_key, f"{requested} needs the workers on the trainer's host, but here the {where}; "
                          f"use {best.name} (or auto)")
    return TransportChoice(requested, f"requested: {where}")
