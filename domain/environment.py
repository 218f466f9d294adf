"""A snapshot of the software and hardware rl-refit runs on, as plain values (`refit doctor`).

An `EnvironmentProbe` (ports/environment_probe.py) takes it; the checks of `app.services.doctor` read
it. Tests build snapshots by hand to stand for other machines (no GPU, old versions, missing
packages).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import attrs

# Distributions `refit doctor` reports, by the name the checks use. Each lists the distribution
# names it may be installed under (the first installed one counts). The engines' own come with
# their profiles (adapters.profiles.DISTRIBUTIONS adds them).
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "compressed-tensors": ("compressed-tensors",),
    "safetensors": ("safetensors",),
    "megatron-core": ("megatron-core",),
    "transformer-engine": ("transformer-engine", "transformer-engine-torch", "transformer-engine-cu12"),
    "nvidia-modelopt": ("nvidia-modelopt",),
    "flash-linear-attention": ("flash-linear-attention", "fla-core"),
    "causal-conv1d": ("causal-conv1d",),
    "triton": ("triton",),
    "torchao": ("torchao",),
    "transformers": ("transformers",),
}

_RELEASE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """The release numbers at the start of a version string.

    Args:
        text: a version such as "0.19.2", "2.13.0+cpu", "0.6.0rc1", or None.

    Returns:
        (0, 19, 2), (2, 13, 0), (0, 6, 0); None when `text` is None or has no leading number.
    """
    if text is None:
        return None
    m = _RELEASE.match(text)
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def version_at_least(text: str | None, minimum: tuple[int, ...]) -> bool:
    """Is the version `text` at least `minimum`? False when it is missing or unreadable.

    Args:
        text: an installed version string, or None when not installed.
        minimum: release numbers, e.g. (0, 18).

    Returns:
        True when the release numbers of `text` compare >= `minimum` (missing parts count as 0).
    """
    have = parse_version(text)
    if have is None:
        return False
    width = max(len(have), len(minimum))
    return have + (0,) * (width - len(have)) >= minimum + (0,) * (width - len(minimum))


def _pair(value: Iterable[int]) -> tuple[int, int]:
    return tuple(value)  # type: ignore[return-value]  # the validator checks the length


def _capability(_: object, __: attrs.Attribute, value: tuple[int, int]) -> None:
    if len(value) != 2 or not all(isinstance(v, int) and v >= 0 for v in value):
        raise ValueError(f"GPU capability must be (major, minor) with non-negative ints, got {value!r}")


@attrs.frozen
class GpuInfo:
    """One visible CUDA device.

    Attributes:
        name: the device name ("NVIDIA H100 80GB HBM3").
        capability: compute capability (major, minor), e.g. (9, 0) for Hopper.
    """

    name: str
    capability: tuple[int, int] = attrs.field(converter=_pair, validator=_capability)

    @property
    def sm(self) -> str:
        return f"SM{self.capability[0]}{self.capability[1]}"


def _gpus(value: Iterable[GpuInfo]) -> tuple[GpuInfo, ...]:
    return tuple(value)


def _frozen_map(value: Mapping[str, str | None]) -> Mapping[str, str | None]:
    return MappingProxyType(dict(value))


def _text_map(optional: bool) -> Callable[[object, attrs.Attribute, Mapping[object, object]], None]:
    """Validator: a mapping of strings to strings (or None, when `optional`)."""
    def check(_: object, attribute: attrs.Attribute, value: Mapping[object, object]) -> None:
        for k, v in value.items():
            if not isinstance(k, str) or not (isinstance(v, str) or (optional and v is None)):
                kind = "a string or null" if optional else "a string"
                raise TypeError(f"{attribute.name}: {k!r} maps to {type(v).__name__} {v!r}; expected {kind}")
    return check


@attrs.frozen
class EnvironmentSnapshot:
    """What is installed and visible on one machine.

    Attributes:
        python: the Python version ("3.11.7").
        packages: distribution (a DISTRIBUTIONS key) -> installed version, None when missing.
        torch_cuda: the CUDA version torch was built with (None for a CPU build).
        gpus: the visible CUDA devices (empty without a usable GPU).
        nccl: torch.distributed has the NCCL backend.
        environ: the environment variables rl-refit honours that are set (name -> value).
        platform: the operating system, in words.
        engine_cpu_kernels: what the vLLM adapter's CPU emulation plugin reports in the engine's
            environment (adapters.vllm.cpu_emulation.status: `native`, format -> None or vLLM's
            reason; `emulated`; `mode`), or None when no vLLM environment was probed.
    """

    python: str = attrs.field(validator=attrs.validators.instance_of(str))
    packages: Mapping[str, str | None] = attrs.field(factory=dict, converter=_frozen_map, validator=_text_map(True))
    torch_cuda: str | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.instance_of(str)))
    gpus: tuple[GpuInfo, ...] = attrs.field(default=(), converter=_gpus)
    nccl: bool = False
    environ: Mapping[str, str] = attrs.field(factory=dict, converter=_frozen_map, validator=_text_map(False))
    platform: str = ""
    engine_cpu_kernels: Mapping[str, Any] | None = None

    def version(self, distribution: str) -> str | None:
        """The installed version of a distribution, None when it is not installed."""
        return self.packages.get(distribution)

    @property
    def capability(self) -> tuple[int, int] | None:
        """The lowest compute capability among the visible GPUs (what every rank can run), or None."""
        return min((g.capability for g in self.gpus), default=None)

    def to_dict(self) -> dict[str, object]:
        return {
            "python": self.python,
            "platform": self.platform,
            "torch_cuda": self.torch_cuda,
            "gpus": [{"name": g.name, "capability": list(g.capability)} for g in self.gpus],
            "nccl": self.nccl,
            "packages": dict(self.packages),
            "environ": dict(self.environ),
            "engine_cpu_kernels": dict(self.engine_cpu_kernels) if self.engine_cpu_kernels is not None else None,
        }
