"""The checks of `refit doctor` that depend on the machine only (no configuration).

Each returns `Check`s: which part of the support matrix works on this machine, and if not why
(package missing, version too old, no GPU, GPU too old) and what to do. The thresholds are
the project's own (pyproject.toml; docs/cli.md#refit-doctor), in one table here.
"""

from __future__ import annotations

import enum

import attrs

from adapters.profiles import PINNED_ENGINES
from domain.environment import EnvironmentSnapshot, parse_version, version_at_least
from domain.quant.backend_policy import MIN_CAPABILITY

MIN_PYTHON = (3, 11)
MIN_VERSIONS: dict[str, tuple[int, ...]] = {  # what rl-refit's own requirements say
    "torch": (2, 10),
    "compressed-tensors": (0, 20),
    "nvidia-modelopt": (0, 47),
}
MEGATRON_NATIVE_HOOK = (0, 18)  # Megatron-Core added `output_processor` to GPTModel.forward in 0.18
MEGATRON_NATIVE_PACKED_GDN = (0, 18)  # and packed (THD) GatedDeltaNet (adapters/megatron/gdn.py)
# Transformer Engine training recipes (override_transformer_config.fp8_recipe / fp4_recipe) and the
# oldest GPU each runs on: FP8 needs Ada/Hopper, FP8 block scaling Hopper, MXFP8 and NVFP4 Blackwell.
TE_RECIPES: dict[str, tuple[int, int]] = {
    "fp8 delayed": (8, 9),
    "fp8 tensorwise": (8, 9),
    "fp8 blockwise": (9, 0),
    "fp8 mxfp8": (10, 0),
    "fp4 nvfp4": (10, 0),
}
_ARCH = {(8, 9): "Ada (SM89)", (9, 0): "Hopper (SM90)", (10, 0): "Blackwell (SM100)"}


class Status(enum.Enum):
    OK = "ok"
    UNAVAILABLE = "unavailable"  # this part of the matrix does not work here (the reason says why)
    WARNING = "warning"  # works, with a limitation worth knowing
    ERROR = "error"  # the given configuration cannot run here


class Reason(enum.Enum):
    PACKAGE_MISSING = "package missing"
    VERSION_TOO_OLD = "version too old"
    NO_GPU = "no GPU"
    GPU_TOO_OLD = "GPU too old"
    VERSION_DIFFERS = "version differs"
    NOT_SUPPORTED = "not supported"
    CONFIG = "configuration"


@attrs.frozen
class Check:
    """One line of the doctor's report.

    Attributes:
        area: platform, export, rollout kernels, engines, trainer, qat, transport or config.
        name: what was checked (an engine, "NVFP4 kernels", ...).
        status: OK, UNAVAILABLE, WARNING or ERROR.
        detail: what was found, in words.
        reason: why it does not work (None when it does).
        fix: what to do about it ("" when nothing is needed).
    """

    area: str
    name: str
    status: Status
    detail: str
    reason: Reason | None = None
    fix: str = ""

    def to_dict(self) -> dict[str, object]:
        return {"area": self.area, "name": self.name, "status": self.status.value, "detail": self.detail,
                "reason": self.reason.value if self.reason else None, "fix": self.fix}


def arch(cap: tuple[int, int]) -> str:
    """`(9, 0)` -> `Hopper (SM90)`."""
    return _ARCH.get(cap, f"SM{cap[0]}{cap[1]}")


def _dotted(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def package_check(env: EnvironmentSnapshot, area: str, dist: str, purpose: str, install: str = "") -> Check:
    """Installed and recent enough (MIN_VERSIONS) for `purpose`, or why not."""
    have = env.version(dist)
    if have is None:
        return Check(area, dist, Status.UNAVAILABLE, f"not installed, so {purpose} is unavailable",
                     Reason.PACKAGE_MISSING, install or f"pip install {dist}")
    need = MIN_VERSIONS.get(dist)
    if need is not None and not version_at_least(have, need):
        return Check(area, dist, Status.UNAVAILABLE, f"{have} is older than {_dotted(need)}, so {purpose} is "
                     "unavailable", Reason.VERSION_TOO_OLD, f"pip install -U '{dist}>={_dotted(need)}'")
    return Check(area, dist, Status.OK, f"{have}: {purpose}")


def gpu_gate(env: EnvironmentSnapshot, area: str, name: str, need: tuple[int, int], what: str) -> Check:
    """Does the GPU have compute capability `need` or newer for `what`?"""
    cap = env.capability
    if cap is None:
        return Check(area, name, Status.UNAVAILABLE, f"{what} needs a {arch(need)} GPU or newer; no CUDA GPU visible",
                     Reason.NO_GPU, "run on a machine with such a GPU (export and codecs still run on CPU)")
    if cap < need:
        return Check(area, name, Status.UNAVAILABLE, f"{what} needs {arch(need)} or newer; this GPU is SM{cap[0]}{cap[1]}",
                     Reason.GPU_TOO_OLD, f"use a {arch(need)} GPU or a preset this GPU runs")
    return Check(area, name, Status.OK, f"{what}: SM{cap[0]}{cap[1]} >= {arch(need)}")


def platform_checks(env: EnvironmentSnapshot) -> list[Check]:
    """Python, torch and its CUDA build, the GPUs."""
    out = []
    if version_at_least(env.python, MIN_PYTHON):
        out.append(Check("platform", "python", Status.OK, env.python))
    else:
        out.append(Check("platform", "python", Status.UNAVAILABLE, f"{env.python} is older than {_dotted(MIN_PYTHON)}",
                         Reason.VERSION_TOO_OLD, f"use Python {_dotted(MIN_PYTHON)} or newer"))
    torch = package_check(env, "platform", "torch", "every part of rl-refit", "pip install 'torch>=2.10'")
    build = f"CUDA {env.torch_cuda} build" if env.torch_cuda else "CPU build"
    out.append(attrs.evolve(torch, detail=f"{torch.detail} ({build})") if torch.status is Status.OK else torch)
    if env.gpus:
        names = ", ".join(f"{g.name} ({g.sm})" for g in env.gpus)
        out.append(Check("platform", "gpu", Status.OK, f"{len(env.gpus)} visible: {names}"))
    else:
        why = "torch is a CPU build" if not env.torch_cuda else f"torch has CUDA {env.torch_cuda} but sees no GPU"
        out.append(Check("platform", "gpu", Status.WARNING,
                         f"no CUDA GPU ({why}): export, codecs, the reference engine and the tests run on CPU; "
                         "rollout engines and their kernels need a GPU", Reason.NO_GPU))
    return out


def export_checks(env: EnvironmentSnapshot) -> list[Check]:
    """Trainer-side quantization and `refit export`."""
    out = [Check("export", "codecs", Status.OK, "FP8_BLOCK, MXFP8, MXFP4, NVFP4 quantize in plain torch on any device")]
    out.append(package_check(env, "export", "compressed-tensors", "compressed-tensors checkpoints (`refit export`)"))
    out.append(package_check(env, "export", "safetensors", "reading and writing checkpoints"))
    return out


def kernel_checks(env: EnvironmentSnapshot) -> list[Check]:
    """Which presets the GPU can serve in the engines (docs/engines.md#kernel-backends-backend-policy)."""
    return [gpu_gate(env, "rollout kernels", f"{preset} kernels", need, f"serving {preset}")
            for preset, need in MIN_CAPABILITY.items()]


def engine_cpu_checks(env: EnvironmentSnapshot) -> list[Check]:
    """Which formats the engine's CPU build serves here: with its own kernel, with the matmul
    emulated (its adapter's CPU emulation plugin), or not (the engine's reason), named as the probe
    labels them (`engine`, `setup`, `emulation`). Empty when no engine environment was probed."""
    found = env.engine_cpu_kernels
    if found is None:
        return []
    engine = str(found.get("engine", "the engine"))
    area = f"rollout kernels ({engine} CPU)"
    if "error" in found:
        return [Check(area, f"{engine} CPU kernels", Status.WARNING,
                      f"could not ask the {engine} environment: {found['error']}", Reason.PACKAGE_MISSING,
                      str(found.get("setup", "install the engine's environment")))]
    mode = found.get("mode", "auto")
    emulated = set(found.get("emulated", ()))
    out = []
    for fmt, reason in dict(found.get("native", {})).items():
        if reason is None:
            out.append(Check(area, fmt, Status.OK, f"{engine}'s own CPU kernel"))
        elif fmt in emulated:
            out.append(Check(area, fmt, Status.WARNING, f"emulated matmul (cpu_emulation={mode}); weight loading, "
                             f"processing and the layerwise reload are {engine}'s own. {engine} has no kernel: {reason}",
                             Reason.NOT_SUPPORTED, "tests and demos only; serve this format on a GPU"))
        else:
            out.append(Check(area, fmt, Status.UNAVAILABLE, f"{engine} has no kernel here: {reason}", Reason.NOT_SUPPORTED,
                             f"{found.get('emulation', 'the engine CPU emulation')} emulates its matmul"))
    return out


def engine_checks(env: EnvironmentSnapshot) -> list[Check]:
    """The rollout engines rl-refit has adapters for."""
    out = [Check("engines", "reference", Status.OK, "the embedded pure-torch engine (CPU or GPU)")]
    for engine, pinned in PINNED_ENGINES.items():
        install = f"pip install -e '.[{engine}]' (pins {engine} {pinned}; on a GPU machine)"
        check = package_check(env, "engines", engine, f"the {engine} rollout adapter", install)
        have = env.version(engine)
        if check.status is Status.OK and not env.gpus:
            check = Check("engines", engine, Status.UNAVAILABLE, f"{have} installed, but {engine} "
                          "serves on CUDA GPUs and none is visible", Reason.NO_GPU, "run on a GPU machine")
        elif check.status is Status.OK and parse_version(have) != parse_version(pinned):
            check = Check("engines", engine, Status.WARNING, f"{have} installed; the adapter is written and checked "
                          f"against {engine} {pinned}, whose internals it calls", Reason.VERSION_DIFFERS, install)
        out.append(check)
    return out


def trainer_checks(env: EnvironmentSnapshot) -> list[Check]:
    """Megatron-Core, packed GDN and Transformer Engine recipes (metadata only, never imported)."""
    mcore = package_check(env, "trainer", "megatron-core", "the Megatron trainer adapters",
                          "pip install --no-deps megatron-core and pip install -e '.[megatron]'")
    out = [mcore]
    if mcore.status is Status.OK:
        version = env.version("megatron-core")
        if version_at_least(version, MEGATRON_NATIVE_PACKED_GDN):
            out.append(Check("trainer", "packed GDN", Status.OK,
                             f"Megatron-Core {version} packs GatedDeltaNet natively; rl-refit adds input validation"))
        else:
            out.append(_patched_gdn(env, version))
    te = env.version("transformer-engine")
    if te is None:
        out.append(Check("trainer", "transformer-engine", Status.UNAVAILABLE,
                         "not installed: Transformer Engine FP8/FP4 training recipes unavailable (BF16 and QAT "
                         "training are not affected)", Reason.PACKAGE_MISSING, "install transformer-engine on a GPU machine"))
    else:
        out.append(Check("trainer", "transformer-engine", Status.OK, f"{te} (read from metadata, not imported)"))
        out += [gpu_gate(env, "trainer", f"TE {recipe}", need, f"TE {recipe} training") for recipe, need in TE_RECIPES.items()]
    return out


def _patched_gdn(env: EnvironmentSnapshot, version: str | None) -> Check:
    if not env.gpus:
        return Check("trainer", "packed GDN", Status.OK, f"Megatron-Core {version} < 0.18: rl-refit's packed-aware "
                     "forward with the reference (plain-torch) kernels on CPU")
    if env.version("flash-linear-attention") is not None:
        return Check("trainer", "packed GDN", Status.OK, f"Megatron-Core {version} < 0.18: rl-refit's packed-aware "
                     f"forward with fla {env.version('flash-linear-attention')} kernels")
    # causal-conv1d can replace fla's convolution only: the gated delta rule always comes from fla.
    return Check("trainer", "packed GDN", Status.UNAVAILABLE, f"Megatron-Core {version} < 0.18 needs rl-refit's "
                 "packed forward, whose GPU kernels come from fla (not installed)", Reason.PACKAGE_MISSING,
                 "pip install -e '.[fla]', or upgrade megatron-core to 0.18+")


def qat_checks(env: EnvironmentSnapshot) -> list[Check]:
    """Quantization-aware training backends."""
    out = [Check("qat", "built-in QAT", Status.OK, "fake quantization through the exporter's own codecs (any device)")]
    modelopt = package_check(env, "qat", "nvidia-modelopt", "the ModelOpt QAT backend", "pip install -e '.[modelopt]'")
    if modelopt.status is Status.OK and not env.gpus:
        modelopt = attrs.evolve(modelopt, detail=f"{modelopt.detail}; without a GPU only numerics=exporter (and FP8 "
                                "block with ModelOpt's own numerics) run: its MX and NVFP4 kernels need CUDA")
    out.append(modelopt)
    return out


def transport_checks(env: EnvironmentSnapshot) -> list[Check]:
    """torch.distributed backends for weight sync."""
    out = [Check("transport", "gloo", Status.OK, "torch.distributed gloo (CPU tensors)")]
    if env.nccl and env.gpus:
        out.append(Check("transport", "nccl", Status.OK, "torch.distributed NCCL"))
    elif not env.gpus:
        out.append(Check("transport", "nccl", Status.UNAVAILABLE, "NCCL moves CUDA tensors; no GPU visible", Reason.NO_GPU,
                         "use gloo, or a GPU machine"))
    else:
        out.append(Check("transport", "nccl", Status.UNAVAILABLE, "this torch build has no NCCL backend",
                         Reason.PACKAGE_MISSING, "install a CUDA build of torch"))
    return out


def environment_checks(env: EnvironmentSnapshot) -> list[Check]:
    """Every machine-only check, in report order."""
    return [*platform_checks(env), *export_checks(env), *kernel_checks(env), *engine_cpu_checks(env), *engine_checks(env),
            *trainer_checks(env), *qat_checks(env), *transport_checks(env)]
