"""`refit demo`'s modes and their options, each option declared once with the modes it belongs to.

    refit demo [OPTIONS]            the embedded model and engine, in this process (the default)
    refit demo vllm [OPTIONS]       a real vLLM engine, each refit against a cold start
    refit demo procs [N] [OPTIONS]  trainer and engine ranks in N processes over gloo
    refit demo qat [PRESET] [...]   training with and without QAT, against the rollout
    refit demo lora [RANK] [...]    a LoRA adapter trained on the embedded model
    refit demo megatron [OPTIONS]   a real Megatron-Core trainer, sharded over processes

Each mode's parser takes only its own options (`refit demo vllm --help` lists them). The spellings
of the previous release (`--engine vllm`, `--procs N`, `--qat [PRESET]`, `--lora RANK`,
`--trainer megatron` on `refit demo` itself) still select their mode, with a notice on stderr,
until the next release (docs/demo.md#modes).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import attrs

from app.cli import options
from app.services.demo_config import EMBEDDED_MODELS
from domain.errors import ConfigError

EMBEDDED = "embedded"
MODES: dict[str, str] = {  # mode -> the one line `refit demo --help` shows for it
    "vllm": "a real vLLM engine (started, in this process, or yours with --attach), each refit against a cold start",
    "procs": "trainer and engine ranks in N processes (2-4) over gloo on 127.0.0.1",
    "qat": "train with QAT in PRESET and without; compare each against the rollout (k3 KL)",
    "lora": "train a LoRA adapter of rank RANK on the embedded model (the steps move only the adapter)",
    "megatron": "a real Megatron-Core trainer, sharded over processes (--tp, --pp, --ep, --etp)",
}
ALL = frozenset({EMBEDDED, *MODES})
PLANNED = frozenset({EMBEDDED, "vllm", "procs", "lora", "megatron"})  # the modes that take a quantization plan
FAULTS = frozenset({EMBEDDED, "vllm", "procs", "lora"})  # the modes --inject-fault hits
ENGINE_MODES = ("qat", "lora", "procs", "megatron")  # the modes that run on the embedded engine or, with --engine, a real one


@attrs.frozen
class Option:
    """One option of `refit demo`: its flags (or a positional's name), the modes that take it,
    its default, and argparse's other arguments (type, choices, help, ...)."""

    flags: tuple[str, ...]
    modes: frozenset[str]
    default: Any
    kwargs: dict[str, Any] = attrs.field(factory=dict)
    helps: dict[str, str] = attrs.field(factory=dict)  # the help of a mode whose defaults differ

    def help_in(self, mode: str) -> str | None:
        """The help `refit demo MODE --help` shows for it: the mode's own defaults only."""
        return self.helps.get(mode, self.kwargs.get("help"))

    @property
    def dest(self) -> str:
        return str(self.kwargs.get("dest") or self.flags[0].lstrip("-").replace("-", "_"))

    @property
    def flag(self) -> str:
        """How an error names it."""
        return self.flags[0] if self.flags[0].startswith("-") else self.flags[0].upper()


def _opt(*flags: str, modes: frozenset[str], default: Any = None, helps: dict[str, str] | None = None,
         **kwargs: Any) -> Option:
    return Option(flags, modes, default, kwargs, helps or {})


_MODELS = "tiny-moe, tiny-dense, micro-moe, micro-dense"
_REAL_ENGINE = "with --engine vllm"


OPTIONS: tuple[Option, ...] = (
    _opt("--linear", modes=PLANNED, help="preset for dense Linear layers, or BF16 (default FP8_BLOCK)",
         helps={"lora": f"the base's preset for dense Linear layers, or BF16 (default FP8_BLOCK; BF16 {_REAL_ENGINE})"}),
    _opt("--moe", modes=PLANNED, help="preset for routed experts, or BF16 (default NVFP4)",
         helps={"vllm": "preset for routed experts, or BF16 (default FP8_BLOCK)",
                "lora": f"the base's preset for routed experts, or BF16 (default NVFP4; BF16 {_REAL_ENGINE})",
                **{mode: f"preset for routed experts, or BF16 (default NVFP4; FP8_BLOCK {_REAL_ENGINE})"
                   for mode in ("procs", "megatron")}}),
    _opt("--moe-activation", modes=PLANNED, help="experts' activation scheme (e.g. mxfp8); default: the preset's"),
    _opt("--linear-activation", modes=PLANNED,
         help="dense layers' activation scheme (none: weight-only); default: the preset's"),
    _opt("--steps", modes=ALL, type=options.steps, help="training-like steps after the initial sync (default 3)",
         helps={"vllm": "training-like steps after the initial sync (default 2)",
                **{mode: f"training-like steps after the initial sync (default 3; 2 {_REAL_ENGINE})"
                   for mode in ("lora", "procs", "megatron")}}),
    _opt("--model", modes=ALL, metavar="NAME|DIR", type=options.model_or_directory(EMBEDDED_MODELS),
         help=f"embedded model ({_MODELS}; default tiny-moe), or DIR: your Hugging Face checkpoint directory "
              "(Qwen3 or Qwen3-MoE)",
         helps={"vllm": f"embedded model ({_MODELS}; default micro-moe), or DIR: your Hugging Face checkpoint "
                        "directory (any model vLLM serves)",
                "lora": f"embedded model ({_MODELS}; default tiny-moe; micro-dense {_REAL_ENGINE}), or DIR: your "
                        "Hugging Face checkpoint directory",
                "qat": f"embedded model ({_MODELS}; default tiny-moe; micro-moe {_REAL_ENGINE})",
                **{mode: f"embedded model ({_MODELS}; default tiny-moe; micro-moe {_REAL_ENGINE})"
                   for mode in ("procs", "megatron")}}),
    _opt("--commit-mode", modes=frozenset({EMBEDDED, "procs", "lora", "megatron"}), default="transactional",
         choices=("transactional", "per-layer")),
    _opt("--bucket-mb", modes=ALL, default=1.0, type=options.mebibytes(),
         help="bucket capacity in MiB (default 1)"),
    _opt("--inject-fault", modes=FAULTS, metavar="FAULT",
         help="[hang:]POINT: bucket:K, begin, finalize, verify or storage: make the plan's refit fail there once",
         helps={"procs": "[hang:]POINT: bucket:K, export:K, begin, finalize, verify or storage: make the plan's "
                         "refit fail there once"}),
    _opt("--fault-step", modes=FAULTS, default=1, type=options.steps,
         help="the step whose refit the fault hits (default 1)"),
    _opt("--presets", modes=frozenset({EMBEDDED, "lora"}), default=False, action="store_true",
         help="add one arm per low-precision preset"),
    _opt("--plot", modes=frozenset({EMBEDDED, "lora"}), metavar="PNG", type=options.plot_file,
         help="draw the mismatch per step for every preset (.png, .pdf or .svg)"),
    _opt("--seed", modes=ALL, default=0, type=options.seed, help=f"seed of the random weights, 0 to {options.MAX_SEED}"),
    _opt("--threads", modes=ALL, default=1, type=options.threads,
         help="torch intra-op threads (default 1: the embedded model's ops are too small to gain from more)"),
    _opt("--json", modes=ALL, default=False, action="store_true", help="print machine-readable JSON"),
    _opt("--colocated", modes=frozenset({"vllm", "lora"}), default=False, action="store_true",
         help="the engine in this process (verl's hybrid engine) instead of a server of its own",
         helps={"lora": f"{_REAL_ENGINE}: the engine in this process (verl's hybrid engine) instead of a server of its "
                        "own"}),
    _opt("--attach", modes=frozenset({"vllm"}), metavar="URL", type=options.server_url,
         help="refit the vLLM server you started at URL (docs/attach.md) instead of starting one"),
    _opt("--engine", modes=frozenset({"qat", "lora", "procs", "megatron"}), default="reference", choices=("reference", "vllm"),
         help="reference (the embedded engine, default) or vllm: a real vLLM engine (qat: in this process, 4-bit "
              "presets on the experts; lora: the adapter mode, each adapter against vLLM's own load of it, micro-dense "
              "and a BF16 base by default)",
         helps={"procs": "reference (the embedded engine, default) or vllm: each engine rank starts a vLLM server, "
                         "each refit against a cold start of the single-process export (FP8_BLOCK, micro-moe and 2 "
                         "steps by default)",
                "megatron": "reference (the embedded engine, default) or vllm: the engine rank starts a vLLM server, "
                            "each refit against a cold start of the unsharded model's export (FP8_BLOCK, micro-moe "
                            "and 2 steps by default)"}),
    _opt("procs", modes=frozenset({"procs"}), default=3, type=int, nargs="?", metavar="N",
         help="processes (2-4): 2 = one trainer + one engine, 3 = two trainer ranks + one engine (default), "
              "4 = two trainer ranks + two engines"),
    _opt("--fault-rank", modes=frozenset({"procs"}), type=int, metavar="R",
         help="the rank --inject-fault hits (default: the last engine; rank 0 for export:K)"),
    _opt("qat", modes=frozenset({"qat"}), default="NVFP4", nargs="?", metavar="PRESET",
         help="the QAT preset (default NVFP4)"),
    _opt("lora", modes=frozenset({"lora"}), default=16, type=options.integer(1, 512), nargs="?", metavar="RANK",
         help="the adapter's rank (default 16)"),
    _opt("--sync", modes=frozenset({"lora"}), dest="lora_sync", choices=("merged", "adapter"),
         help="merged (default: W + (alpha/r) B A refitted whole) or adapter (the adapter alone each step, the "
              "base once)"),
    _opt("--tp", modes=frozenset({"megatron"}), default=1, type=int, help="tensor-parallel size (default 1)"),
    _opt("--pp", modes=frozenset({"megatron"}), default=1, type=int, help="pipeline-parallel size (default 1)"),
    _opt("--ep", modes=frozenset({"megatron"}), default=1, type=int, help="expert-parallel size (default 1)"),
    _opt("--etp", modes=frozenset({"megatron"}), default=1, type=int,
         help="expert tensor-parallel size: 1 (the default: whole experts), --tp, or any size with --tp 1"),
    _opt("--lr", modes=frozenset({"megatron"}), default=0.1, type=float, help="the SGD learning rate (default 0.1)"),
)
VERBOSE_HELP = "log the canonical line of every refit (stderr), and the notices of third-party packages"


@attrs.frozen
class Legacy:
    """A spelling of the previous release that selects a mode: the option on `refit demo` itself,
    and what it becomes."""

    flag: str
    dest: str
    mode: Callable[[Any], str | None]  # the option's value -> its mode (None: the embedded one)
    kwargs: dict[str, Any] = attrs.field(factory=dict)


LEGACY: tuple[Legacy, ...] = (
    Legacy("--trainer", "trainer", lambda v: "megatron" if v == "megatron" else None,
           {"choices": ("reference", "megatron")}),
    Legacy("--procs", "procs", lambda v: "procs", {"type": int, "metavar": "N"}),
    Legacy("--qat", "qat", lambda v: "qat", {"nargs": "?", "const": "NVFP4", "metavar": "PRESET"}),
    Legacy("--lora", "lora", lambda v: "lora", {"type": options.integer(1, 512), "metavar": "RANK"}),
    Legacy("--engine", "engine", lambda v: "vllm" if v == "vllm" else None, {"choices": ("reference", "vllm")}),
)
LEGACY_ONLY = {"--lora-sync": "lora_sync"}  # the old name of `refit demo lora --sync`


def _add(parser: argparse.ArgumentParser, option: Option, mode: str) -> None:
    shown = mode in option.modes
    kwargs = dict(option.kwargs)
    kwargs["help"] = option.help_in(mode) if shown else argparse.SUPPRESS
    if option.flags[0].startswith("-"):
        parser.add_argument(*option.flags, default=argparse.SUPPRESS, **kwargs)
    elif shown:  # a positional: its mode's own, always set (argparse converts a default it is not given)
        parser.add_argument(option.flags[0], default=option.default, **kwargs)


def _add_options(parser: argparse.ArgumentParser, mode: str) -> None:
    """The options of `mode` (shown in its help), and every other one hidden: they parse, so that
    `resolve` refuses them by name, and the spellings of the previous release still run."""
    taken = {flag for option in OPTIONS if option.flags[0].startswith("-") for flag in option.flags}
    for option in OPTIONS:
        _add(parser, option, mode)
    for legacy in LEGACY:
        if legacy.flag not in taken:
            parser.add_argument(legacy.flag, dest=legacy.dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                                **legacy.kwargs)
    for flag, dest in LEGACY_ONLY.items():
        parser.add_argument(flag, dest=dest, choices=("merged", "adapter"), default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS)
    parser.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`refit demo`'s options (the embedded mode's), and one sub-parser per mode."""
    _add_options(p, EMBEDDED)
    modes = p.add_subparsers(dest="mode", metavar="MODE", title="modes (default: the embedded model and engine)",
                             parser_class=type(p))
    for mode, help_line in MODES.items():
        sub = modes.add_parser(mode, help=help_line, description=f"refit demo {mode}: {help_line}")
        _add_options(sub, mode)
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                         help="on an error, also print its traceback")


def resolve(args: argparse.Namespace, notice: Callable[[str], None] | None = None) -> str:
    """The mode `args` runs, with every option of every mode set (its default where not given);
    the spellings of the previous release select their mode with a notice.

    Raises:
        ConfigError: an option the mode does not take, naming it and the mode's help.
    """
    given = {k for k in vars(args) if k not in ("command", "mode", "debug", "verbose")}
    mode = getattr(args, "mode", None)
    legacy: list[str] = []
    if mode is None:
        for spelling in LEGACY:
            if spelling.dest in given and (chosen := spelling.mode(getattr(args, spelling.dest))) is not None:
                legacy.append(spelling.flag)
                mode = mode or chosen
        if "lora_sync" in given and mode is None:
            raise ConfigError("--lora-sync", "goes with a LoRA adapter: `refit demo lora RANK --sync MODE`")
    mode = mode or EMBEDDED
    takes = {o.dest for o in OPTIONS if mode in o.modes}
    if legacy:  # the options that selected the mode are the mode, not options of it
        takes |= {s.dest for s in LEGACY if s.flag in legacy and s.mode(getattr(args, s.dest)) == mode}
        # `--qat --engine vllm`, `--lora 8 --engine vllm`, `--procs 3 --engine vllm`
        takes |= {"engine"} if mode in ENGINE_MODES else set()
        takes |= {"lora_sync"} if mode == "lora" else set()
    # the previous release's defaults, spelled out, select nothing
    takes |= {"engine"} if mode != "vllm" and getattr(args, "engine", "reference") == "reference" else set()
    takes |= {"trainer"} if mode != "megatron" and getattr(args, "trainer", "reference") == "reference" else set()
    for dest in sorted(given - takes, key=_order):
        raise ConfigError(_flag(dest), _not_taken(dest, mode, args))
    if legacy:
        (notice or _stderr)(f"refit demo: `{' '.join(legacy)}` selects a mode, as the previous release did: use "
                            f"`refit demo {mode} ...` (`refit demo {mode} --help`); the old spelling goes in the "
                            "next release")
    for option in OPTIONS:
        if not hasattr(args, option.dest):
            setattr(args, option.dest, option.default)
    args.engine = "vllm" if mode == "vllm" else args.engine if mode in ENGINE_MODES else "reference"
    args.trainer = "megatron" if mode == "megatron" else "reference"
    if mode != "procs" and "procs" not in given:
        args.procs = None
    if mode != "qat":
        args.qat = None
    if mode != "lora":
        args.lora = None
    args.mode = mode
    return mode


def _command(mode: str) -> str:
    return "refit demo" if mode == EMBEDDED else f"refit demo {mode}"


def _not_taken(dest: str, mode: str, args: argparse.Namespace) -> str:
    """Why `refit demo MODE` refuses the option written for `dest`, and where it goes."""
    selector = next((s for s in LEGACY if s.dest == dest), None)
    chosen = selector.mode(getattr(args, dest)) if selector is not None else None
    if chosen is not None and not any(o.dest == dest and mode in o.modes for o in OPTIONS):
        where = f"it selects `{_command(chosen)}`, a mode of its own"
    else:
        modes = [m for o in OPTIONS if o.dest == dest for m in sorted(o.modes) if m != mode]
        where = f"it is an option of {' and '.join(f'`{_command(m)}`' for m in modes)}" if modes else ""
    return (f"is not an option of `{_command(mode)}`{'; ' + where if where else ''} "
            f"(see `{_command(mode)} --help`)")


def _order(dest: str) -> int:
    return next((i for i, o in enumerate(OPTIONS) if o.dest == dest), len(OPTIONS))


def _flag(dest: str) -> str:
    """How an error names the option written for `dest` (an option, else its previous spelling)."""
    for option in OPTIONS:
        if option.dest == dest and option.flags[0].startswith("-"):
            return option.flag
    for legacy in LEGACY:
        if legacy.dest == dest:
            return legacy.flag
    return next((f for f, d in LEGACY_ONLY.items() if d == dest), f"--{dest.replace('_', '-')}")


def _stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
