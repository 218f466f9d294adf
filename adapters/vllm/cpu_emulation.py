"""Emulated matmuls for vLLM's CPU platform: every format vLLM serves, on any x86-64 CPU.

vLLM's CPU build has native kernels for BF16 everywhere and for FP8 block only where the CPU has
AMX tiles; it has none for MXFP8, MXFP4 or NVFP4 on the CPU platform, though it ships emulation
kernels for them (used on ROCm and CUDA as a last resort). This plugin registers those emulation
kernels for the CPU platform, and rl-refit's plain-torch FP8 block kernel
(adapters.vllm.fp8_block_kernel) where vLLM's need AMX. Only the matmul is replaced: weight
creation, loading, `process_weights_after_loading` and the layerwise reload a refit exercises stay
vLLM's own code.

How it is loaded: vLLM calls every `vllm.general_plugins` entry point in each of its processes (the
front end, the engine core, every worker); rl-refit declares adapters.vllm.plugin:register there
(pyproject.toml), which calls `apply` with the mode the composition root put in the engine's
environment (`rollout.engine_kwargs.vllm.cpu_emulation`, as `ENV_VAR`). It does nothing unless the
platform is vLLM's CPU platform and the mode allows:

| mode | formats whose matmul is emulated |
|---|---|
| `off` | none |
| `auto` (default) | those with no native kernel on this CPU, judged by vLLM's own kernel reasons |
| `on` | every format the plugin knows (FP8_BLOCK too where AMX is present) |

The decision itself (`emulated_formats`) is a pure function, tested without vLLM.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from typing import Any

import attrs

from adapters.vllm.qualname import resolve

ENV_VAR = "RL_REFIT_VLLM_CPU_EMULATION"
MODES = ("auto", "on", "off")
# vLLM's logger tree: its handler and format apply to children of "vllm".
LOGGER = "vllm.rl_refit.cpu_emulation"


@attrs.frozen
class EmulatedFormat:
    """One format's matmul the plugin can replace.

    Attributes:
        name: the rl-refit preset (FP8_BLOCK, MXFP8, MXFP4, NVFP4).
        registry: the name of vLLM's per-platform kernel table in
            `vllm.model_executor.kernels.linear` that kernel selection reads.
        kernel: "module:qualname" of the kernel class registered for the CPU platform.
    """

    name: str
    registry: str
    kernel: str


FORMATS: tuple[EmulatedFormat, ...] = (
    EmulatedFormat("FP8_BLOCK", "_POSSIBLE_FP8_BLOCK_KERNELS",
                   "adapters.vllm.fp8_block_kernel:TorchFp8BlockScaledMMKernel"),
    EmulatedFormat("MXFP8", "_POSSIBLE_MXFP8_KERNELS",
                   "vllm.model_executor.kernels.linear.mxfp8.emulation:EmulationMxfp8LinearKernel"),
    EmulatedFormat("MXFP4", "_POSSIBLE_MXFP4_KERNELS",
                   "vllm.model_executor.kernels.linear.mxfp4.emulation:EmulationMxfp4LinearKernel"),
    EmulatedFormat("NVFP4", "_POSSIBLE_NVFP4_KERNELS",
                   "vllm.model_executor.kernels.linear.nvfp4.emulation:EmulationNvFp4LinearKernel"),
)


def parse_mode(value: str | None) -> str:
    """The mode named by `value` (None or empty = "auto"). Raises ValueError for anything else."""
    mode = (value or "auto").strip().lower()
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR}={value!r}: expected one of {', '.join(MODES)}")
    return mode


def emulated_formats(mode: str, *, on_cpu: bool, native: Mapping[str, str | None]) -> tuple[str, ...]:
    """The formats whose matmul the plugin emulates.

    Args:
        mode: "auto", "on" or "off".
        on_cpu: vLLM's current platform is its CPU platform (never anything on a GPU).
        native: format -> None when vLLM has a kernel for it on this machine, else vLLM's reasons
            for having none.

    Returns:
        Format names, in FORMATS order.
    """
    if not on_cpu or mode == "off":
        return ()
    return tuple(f.name for f in FORMATS if mode == "on" or native.get(f.name) is not None)


def native_kernels() -> dict[str, str | None]:
    """For each format, None when one of vLLM's CPU kernels for it is supported on this machine,
    else vLLM's reasons (its own `is_supported()` answers), joined. Imports vllm."""
    import vllm.model_executor.kernels.linear as linear
    from vllm.platforms import PlatformEnum

    out: dict[str, str | None] = {}
    for fmt in FORMATS:
        kernels = [k for k in getattr(linear, fmt.registry).get(PlatformEnum.CPU, []) if not _ours(k)]
        reasons = []
        for kernel in kernels:
            ok, reason = kernel.is_supported()
            if ok:
                break
            reasons.append(f"{kernel.__name__} {reason}")
        else:
            out[fmt.name] = "; ".join(reasons) or f"vLLM registers no {fmt.name} linear kernel for the CPU platform"
            continue
        out[fmt.name] = None
    return out


def _ours(kernel: type) -> bool:
    return any(kernel.__module__ + ":" + kernel.__qualname__ == f.kernel for f in FORMATS)


def install(names: tuple[str, ...]) -> list[str]:
    """Register the kernels of `names` for vLLM's CPU platform, after vLLM's own (so a native
    kernel that can implement a layer is still preferred); idempotent. Returns the kernel names."""
    import vllm.model_executor.kernels.linear as linear
    from vllm.platforms import PlatformEnum

    done = []
    for fmt in FORMATS:
        if fmt.name not in names:
            continue
        kernel = resolve(fmt.kernel)
        table = getattr(linear, fmt.registry).setdefault(PlatformEnum.CPU, [])
        if kernel not in table:
            table.append(kernel)
        done.append(kernel.__name__)
    # MoE experts of the same formats: vLLM's expert-backend look-ups wrapped (adapters.vllm.moe_emulation).
    from adapters.vllm import moe_emulation

    return done + moe_emulation.install(names)


def status(mode: str | None) -> dict[str, Any]:
    """What the plugin does in this process. Imports vllm.

    Args:
        mode: auto, on or off (None or empty: auto).

    Returns:
        platform, on_cpu, mode; `native`: format -> None (vLLM has a kernel on this machine) or
        vLLM's reasons; `emulated`: the formats whose emulated kernel is registered and supported
        here; `unavailable`: format -> reason, for formats with neither (the emulated kernel's
        own `is_supported()` reason).
    """
    from vllm.platforms import current_platform

    chosen = parse_mode(mode)
    on_cpu = bool(current_platform.is_cpu())
    native = native_kernels() if on_cpu else {}
    emulated, unavailable = [], {}
    for name in emulated_formats(chosen, on_cpu=on_cpu, native=native):
        kernel = resolve(next(f.kernel for f in FORMATS if f.name == name))
        ok, reason = kernel.is_supported()
        if ok:
            emulated.append(name)
        elif native.get(name) is not None:
            unavailable[name] = f"{native[name]}; {kernel.__name__}: {reason}"
    for name, reason in native.items():
        if reason is not None and name not in emulated and name not in unavailable:
            unavailable[name] = reason
    return {"platform": str(current_platform.device_name), "on_cpu": on_cpu, "mode": chosen, "native": native,
            "emulated": emulated, "unavailable": unavailable}


def apply(mode: str | None) -> list[str]:
    """Emulate what this CPU has no kernel for, per `mode`, in this (vLLM) process: register the
    kernels and say so in vLLM's log. Does nothing off vLLM's CPU platform. Returns the kernels."""
    log = logging.getLogger(LOGGER)
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return []
        state = status(mode)
    except ValueError as err:
        log.error("rl-refit CPU emulation is off: %s", err)
        return []
    if not state["emulated"]:
        return []
    kernels = install(tuple(state["emulated"]))
    log.info("rl-refit CPU emulation (%s=%s): emulated matmuls for %s (%s); weights, loading and reload stay vLLM's",
             ENV_VAR, state["mode"], ", ".join(state["emulated"]), ", ".join(kernels))
    return kernels


def main() -> int:
    """`python -m adapters.vllm.cpu_emulation [MODE]`: print `status` as one JSON line."""
    mode = sys.argv[1] if len(sys.argv) > 1 else None
    print(json.dumps(status(mode)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
