"""Checkpoint errors: reading a Hugging Face checkpoint and publishing an export (`refit export`)."""

from __future__ import annotations

from domain.errors.base import RefitError


class CheckpointError(RefitError, ValueError):
    """A model directory is not a readable Hugging Face safetensors checkpoint."""


class OutputNotEmpty(RefitError, FileExistsError):
    """`refit export --out DIR` names a non-empty directory and `--force` was not given."""


class OutputProtected(OutputNotEmpty):
    """`refit export --out DIR --force` would replace a directory `--force` never replaces: the
    file-system root, the current directory, the home directory, or one holding either."""


class OutputOverlapsModel(CheckpointError):
    """`refit export --out DIR` is the model directory, inside it or above it (symlinks resolved)."""


class OutputBusy(RefitError, BlockingIOError):
    """Another export to the same `--out` is running (it holds the destination's lock), or the lock's
    owner cannot be proven dead."""


class ForeignLockFile(RefitError, FileExistsError):
    """Where an export keeps its lock (`.NAME.lock` beside `--out`) is something rl-refit did not
    create (a file, a symlink, a directory); it is never removed."""


class OutputChanged(RefitError, FileExistsError):
    """`--out` changed between the export's check and its publish; nothing was replaced."""


class OutputNotWritable(RefitError, OSError):
    """The export could not write its output (permissions, a read-only file system, a full disk)."""


class SourceChanged(CheckpointError):
    """A file of the model changed (size, modification time, or replaced) while it was read."""


class QuantizedSource(CheckpointError):
    """The source checkpoint stores quantized tensors in a layout the export cannot decode."""


class NativeLayoutMismatch(CheckpointError):
    """A checkpoint passed through untouched (its own quantization_config, which the trainer cannot
    produce) holds tensors that are not the layout the config says: BF16 weights under a GPTQ
    config, quantized weights without their scales, another bit width. Carries the tensor's name."""

    def __init__(self, tensor: str, problem: str, fix: str) -> None:
        self.tensor = tensor
        super().__init__(f"tensor {tensor!r} {problem}; {fix}")
