"""Export service: HF checkpoint directory -> quantized checkpoint directory, atomically.

Everything is written to a hidden temporary directory next to the destination and renamed into
place only once complete, so a failure never leaves a partial checkpoint behind.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import structlog

from adapters.hf_checkpoint.reader import CONFIG_NAME, INDEX_NAME, HfCheckpoint
from adapters.hf_checkpoint.writer import DEFAULT_SHARD_BYTES, CheckpointWriter
from app.services.planning import PlanReport
from domain.errors import CheckpointError, OutputNotEmpty
from domain.quant.stream import checkpoint_specs, quantize_stream

# Files never copied from the source directory: weights and what is rewritten.
_SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
_SKIP_NAMES = (CONFIG_NAME, INDEX_NAME, "pytorch_model.bin.index.json")


@attrs.frozen
class ExportResult:
    """What an export wrote."""

    out_dir: str
    layout: str
    tensors_in: int
    tensors_out: int
    bytes_in: int
    bytes_out: int
    shards: int
    copied_files: tuple[str, ...]
    seconds: float

    @property
    def throughput_mb_s(self) -> float:
        return self.bytes_in / 2**20 / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["throughput_mb_s"] = self.throughput_mb_s
        return d


def check_destination(out: Path, source: Path, *, force: bool) -> None:
    """Refuse an output that is the source, a file, or a non-empty directory (without force).

    Args:
        out: the destination directory.
        source: the model directory.
        force: replace a non-empty destination.

    Returns:
        None. Raises OutputNotEmpty or CheckpointError.
    """
    if out.resolve() == source.resolve():
        raise CheckpointError(f"--out {str(out)!r} is the model directory itself; choose another directory")
    if out.exists() and not out.is_dir():
        raise OutputNotEmpty(f"--out {str(out)!r} is a file; remove it or choose a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise OutputNotEmpty(
            f"--out {str(out)!r} is not empty; choose an empty directory or pass --force to replace it"
        )


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


def _write(checkpoint: HfCheckpoint, tmp: Path, report: PlanReport, shard_bytes: int) -> tuple[int, int, int]:
    plan = report.plan
    specs = [s for n, shape, dtype in checkpoint.tensor_specs() for s in checkpoint_specs(plan, n, shape, dtype)]
    writer = CheckpointWriter(tmp, specs, shard_bytes)
    count = 0
    try:
        for name, tensor in quantize_stream(plan, checkpoint.iter_tensors()):
            writer.write(name, tensor)
            count += 1
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return count, writer.total_bytes, len(set(writer.weight_map.values()))


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
        shard_bytes: safetensors shard size bound.
        clock: time source (tests).

    Returns:
        The ExportResult.
    """
    out = Path(out)
    bound = structlog.get_logger().bind(model=str(checkpoint.path), out=str(out), layout=report.resolution.layout)
    check_destination(out, checkpoint.path, force=force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    start = clock()
    try:
        count, bytes_out, shards = _write(checkpoint, tmp, report, shard_bytes)
        config = output_config(checkpoint.config, report)
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        copied = []
        for f in sorted(checkpoint.path.iterdir()):
            if f.is_file() and f.name not in _SKIP_NAMES and not f.name.endswith(_SKIP_SUFFIXES):
                shutil.copy2(f, tmp / f.name)
                copied.append(f.name)
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = clock() - start
    result = ExportResult(
        str(out), report.resolution.layout, len(checkpoint.tensor_shapes()), count,
        checkpoint.total_bytes, bytes_out, shards, tuple(copied), seconds,
    )
    bound.info("export finished", tensors_out=count, bytes_out=bytes_out, seconds=round(seconds, 3))
    return result
