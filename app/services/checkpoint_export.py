"""Export service: HF checkpoint directory -> quantized checkpoint directory, atomically.

Everything is written to a private hidden directory `.NAME.partial-TOKEN` beside the destination
and fsynced; it is published with an atomic rename that replaces only what was checked when the
export started (`adapters.system.atomic_dir.publish`), under the destination's lock
(`adapters.system.ownership.DestinationLock`), so that two exports to one destination never both
write it and a killed export never leaves a half-written checkpoint where a complete one is
expected. The destination may not overlap the model (itself, inside or above it, through symlinks
too), and `--force` never replaces the root, the current or the home directory. The lock's owner
record names its partial directory: the next export removes those two of a provably dead export,
and nothing else. The source is checked against its snapshot before publishing (`SourceChanged`).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs
import structlog
import torch

from adapters.hf_checkpoint.reader import CONFIG_NAME, INDEX_NAME, HfCheckpoint
from adapters.hf_checkpoint.writer import (
    DEFAULT_SHARD_BYTES,
    CheckpointWriter,
    fsync_file,
    write_durably,
    writing,
)
from adapters.system.atomic_dir import DirState, fsync_dir, publish
from adapters.system.files import open_regular
from adapters.system.ownership import DestinationLock
from app.services.planning import PlanReport
from domain.errors import (
    CheckpointError,
    ConfigError,
    NonFiniteTensor,
    OutputNotEmpty,
    OutputOverlapsModel,
    OutputProtected,
)
from domain.quant.stream import checkpoint_specs, quantize_stream

# Files never copied from the source directory: weights and what is rewritten.
_SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
_SKIP_NAMES = (CONFIG_NAME, INDEX_NAME, "pytorch_model.bin.index.json")
_CHECKED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@attrs.frozen
class ExportResult:
    """What an export wrote.

    Attributes:
        decoded: preset -> modules the source stored quantized in it, decoded to dense weights
            before the plan quantized (or kept) them again; empty for a BF16 source.
    """

    out_dir: str
    layout: str
    tensors_in: int
    tensors_out: int
    bytes_in: int
    bytes_out: int
    shards: int
    copied_files: tuple[str, ...]
    seconds: float
    decoded: dict[str, int] = attrs.field(factory=dict)

    @property
    def throughput_mb_s(self) -> float:
        return self.bytes_in / 2**20 / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["throughput_mb_s"] = self.throughput_mb_s
        return d


def destination(out: str | Path) -> Path:
    """The destination as an absolute path whose parent is resolved (the last component is kept,
    so that a symlink named as --out is seen as one).

    Args:
        out: --out as given.

    Returns:
        The path. Raises ConfigError for an empty or blank `out` (an unset shell variable), and
        OutputProtected for the file-system root.
    """
    if not str(out).strip():
        raise ConfigError("--out", f"{str(out)!r} is empty or blank (an unset shell variable?); name the "
                          "directory to write")
    try:
        path = Path(os.path.abspath(out))
    except FileNotFoundError:  # a relative --out in a working directory that was removed
        raise ConfigError("--out", f"{str(out)!r} is relative to the current directory, which no longer exists; "
                          "change to an existing directory, or pass an absolute path") from None
    if not path.name:
        raise OutputProtected(f"--out {str(out)!r} is the file-system root; choose a directory to create")
    return _real(path.parent) / path.name


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))  # never raises, not even on a symlink loop


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def check_overlap(out: Path, checkpoint: HfCheckpoint) -> None:
    """Refuse a destination that is the model directory, inside it or above it, or that holds
    (through symlinks) a file the model reads.

    Args:
        out: the destination (from `destination`).
        checkpoint: the source.

    Returns:
        None. Raises OutputOverlapsModel.
    """
    model = _real(checkpoint.path)
    real = _real(out)  # follows a symlinked --out
    if _inside(real, model) or _inside(model, real):
        where = "is" if real == model else "is inside" if _inside(real, model) else "contains"
        raise OutputOverlapsModel(
            f"--out {str(out)!r} {where} the model directory {str(model)!r}; replacing it would destroy the "
            "source: choose a directory outside the model"
        )
    for f in [*checkpoint.source_files(), *checkpoint.path.iterdir()]:
        if _inside(_real(f), real):
            raise OutputOverlapsModel(
                f"the model's file {f.name!r} resolves to {str(_real(f))!r}, inside --out {str(out)!r}; "
                "replacing --out would destroy the source: choose another directory"
            )


def _home() -> Path | None:
    """The account's home directory, from the password database (not $HOME: only the composition
    root reads the environment); None for a uid without an account."""
    try:
        return Path(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:
        return None


def _protected() -> list[tuple[str, Path]]:
    """Directories `--force` never replaces, nor one holding them."""
    places = [("the file-system root", Path("/"))]
    with contextlib.suppress(FileNotFoundError):  # a removed working directory cannot be replaced
        places.append(("the current directory", Path.cwd()))
    home = _home()
    if home is not None:
        places.append(("the home directory", home))
    return [(name, _real(p)) for name, p in places]


def _refuse_protected(out: Path) -> None:
    real = _real(out)
    for name, place in _protected():
        if _inside(place, real):
            where = "is" if place == real else "contains"
            raise OutputProtected(
                f"--out {str(out)!r} {where} {name} {str(place)!r}, which --force never replaces; name a directory "
                "of its own (e.g. a new one inside it)"
            )


def _not_empty(out: Path) -> OutputNotEmpty:
    return OutputNotEmpty(f"--out {str(out)!r} is not empty; choose an empty directory or pass --force to replace it")


def _has_entries(directory: Path) -> bool:
    with os.scandir(directory) as entries:
        return any(True for _ in entries)


def check_destination(out: Path, *, force: bool) -> DirState:
    """Refuse an output that is a symlink, a file, or a non-empty directory (without force; with
    force, one that is or holds the root, the current or the home directory).

    Args:
        out: the destination (from `destination`).
        force: replace a non-empty destination.

    Returns:
        What the destination is now (publish replaces only exactly that). Raises OutputNotEmpty,
        OutputProtected.
    """
    if out.is_symlink():
        raise OutputNotEmpty(f"--out {str(out)!r} is a symlink; pass the directory it points to, or another path")
    if out.exists() and not out.is_dir():
        raise OutputNotEmpty(f"--out {str(out)!r} is a file; remove it or choose a directory")
    if out.is_dir() and _has_entries(out):  # before walking it: it may be a whole home directory
        if not force:
            raise _not_empty(out)
        _refuse_protected(out)
    state = DirState.of(out)
    if not state.empty and not force:  # filled since the look above
        raise _not_empty(out)
    return state


def output_config(source_config: dict[str, Any], report: PlanReport) -> dict[str, Any]:
    """config.json of the exported checkpoint: the source's, with the engine's quantization_config.

    Args:
        source_config: the source config.json.
        report: the plan.

    Returns:
        The new config dict (the native config is kept unchanged for pass-through layouts).
    """
    config = json.loads(json.dumps(source_config))
    if report.resolution.layout == "native-passthrough":
        return config
    config.pop("quantization_config", None)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].pop("quantization_config", None)
    if report.engine_config is not None:
        config["quantization_config"] = report.engine_config
    return config


def _finite(stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every floating tensor written must be finite: a kept `lm_head` or norm with NaN/Inf is no
    more a valid checkpoint than a quantized one (the codecs check theirs)."""
    for name, tensor in stream:
        if tensor.dtype in _CHECKED_DTYPES and not bool(torch.isfinite(tensor).all()):
            raise NonFiniteTensor(name, "holds NaN or Inf values",
                                  "the source checkpoint is damaged or diverged; nothing was exported")
        yield name, tensor


def _write(checkpoint: HfCheckpoint, tmp: Path, report: PlanReport, shard_bytes: int) -> tuple[int, int, int]:
    plan = report.plan
    raw = report.resolution.layout == "native-passthrough"
    specs = [s for n, shape, dtype in checkpoint.tensor_specs(raw=raw) for s in checkpoint_specs(plan, n, shape, dtype)]
    writer = CheckpointWriter(tmp, specs, shard_bytes)
    count = 0
    try:
        for name, tensor in _finite(quantize_stream(plan, checkpoint.iter_tensors(raw=raw, plan=plan))):
            writer.write(name, tensor)
            count += 1
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return count, writer.total_bytes, len(set(writer.weight_map.values()))


def _copy_extras(checkpoint: HfCheckpoint, tmp: Path) -> list[str]:
    copied = []
    for f in sorted(checkpoint.path.iterdir()):
        if f.is_file() and f.name not in _SKIP_NAMES and not f.name.endswith(_SKIP_SUFFIXES):
            with writing(tmp / f.name):
                _copy_regular(f, tmp / f.name)
            copied.append(f.name)
    return copied


def _copy_regular(src: Path, dst: Path) -> None:
    """Copy a regular file durably, with its times and mode (a FIFO swapped in meanwhile is refused,
    never waited on)."""
    try:
        fd = open_regular(src)
    except OSError as err:
        raise CheckpointError(f"{src}: cannot be read ({err.strerror or err}); the model's files must be "
                              "regular files") from None
    with os.fdopen(fd, "rb") as source, open(dst, "xb") as target:
        shutil.copyfileobj(source, target)
    shutil.copystat(src, dst)
    fsync_file(dst)


def export_checkpoint(
    checkpoint: HfCheckpoint,
    out: str | Path,
    report: PlanReport,
    *,
    force: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    clock: Callable[[], float] = time.perf_counter,
) -> ExportResult:
    """Write the quantized checkpoint directory for `report`'s plan.

    Args:
        checkpoint: the source checkpoint (streamed tensor by tensor).
        out: the destination directory (created; replaced only with force).
        report: the resolved plan (make_plan with the same checkpoint).
        force: replace a non-empty destination.
        shard_bytes: safetensors shard size bound (positive).
        clock: time source (tests).

    Returns:
        The ExportResult. Raises ConfigError (an empty `out`), OutputOverlapsModel,
        OutputNotEmpty, OutputProtected, OutputBusy (another export to `out` runs),
        ForeignLockFile (something not ours where the lock goes), OutputChanged (`out` changed
        meanwhile), SourceChanged (the model changed meanwhile), OutputNotWritable, and the plan's
        and codecs' errors; on any of them `out` is as it was.
    """
    if shard_bytes <= 0:
        raise CheckpointError(f"the shard size must be positive, got {shard_bytes} bytes")
    if not checkpoint.has_config:
        raise CheckpointError(f"{str(checkpoint.path)!r} has no {CONFIG_NAME}; engines need the model's config to load "
                              "the export: add the config.json of the model")
    dest = destination(out)
    check_overlap(dest, checkpoint)
    bound = structlog.get_logger().bind(model=str(checkpoint.path), out=str(dest), layout=report.resolution.layout)
    with writing(dest.parent):
        dest.parent.mkdir(parents=True, exist_ok=True)
    lock = DestinationLock(dest, protected=[checkpoint.path])
    try:
        with writing(lock.path):
            lock.acquire()
        checked = check_destination(dest, force=force)
        start = clock()
        with writing(lock.partial):
            tmp = lock.create_partial()
        count, bytes_out, shards = _write(checkpoint, tmp, report, shard_bytes)
        config = output_config(checkpoint.config, report)
        write_durably(tmp / CONFIG_NAME, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
        copied = _copy_extras(checkpoint, tmp)
        checkpoint.check_unchanged()  # what was read is the model as it was when its headers were read
        with writing(dest):
            fsync_dir(tmp)
            publish(tmp, dest, checked)
    finally:
        lock.remove_partial()  # ours, on every way out (after publish it holds nothing)
        lock.release()
    seconds = clock() - start
    decoded = checkpoint.decoded_formats() if report.resolution.layout != "native-passthrough" else {}
    result = ExportResult(
        str(out), report.resolution.layout, len(checkpoint.tensor_shapes(raw=True)), count,
        checkpoint.total_bytes, bytes_out, shards, tuple(copied), seconds, decoded,
    )
    bound.info("export finished", tensors_out=count, bytes_out=bytes_out, seconds=round(seconds, 3), decoded=decoded)
    return result
