"""Validating argparse `type=` functions: a bad option value ends in one line naming the option
(argparse adds `argument --NAME:`) and exit status 2, before the command does anything.

Each factory returns a function from the command-line text to the value, raising
argparse.ArgumentTypeError with what is wrong and what is accepted.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

MAX_SEED = 2**32 - 1  # seeds are combined with step numbers; every such sum stays a valid torch seed
MAX_THREADS = 1024
MAX_MIB = float(1 << 20)  # 1 TiB
MIN_MIB = 2.0**-20  # one byte


def _short(text: str, limit: int = 200) -> str:
    return repr(text) if len(text) <= limit else repr(text[: limit - 3] + "...")


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer in [low, high] (no upper bound when high is None).

    Args:
        low: the smallest accepted value.
        high: the largest accepted value, or None.

    Returns:
        The `type=` function.
    """
    span = f"from {low} to {high}" if high is not None else f"{low} or more"

    def parse(text: str) -> int:
        try:
            value = int(text.strip(), 10) if len(text) <= 40 else None  # no 4300-digit conversions
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected a whole number {span}, got {_short(text, 40)}")
        return value

    return parse


def mebibytes(high: float = MAX_MIB) -> Callable[[str], float]:
    """A finite number of MiB, at least one byte and at most `high`.

    Args:
        high: the largest accepted value.

    Returns:
        The `type=` function.
    """
    def parse(text: str) -> float:
        try:
            value = float(text) if len(text) <= 40 else math.nan
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or not MIN_MIB <= value <= high:
            raise argparse.ArgumentTypeError(f"expected a number of MiB above 0 (one byte, {MIN_MIB:.3g}, or more) and "
                                             f"at most {high:.0f}, got {_short(text, 40)}")
        return value

    return parse


def output_file(suffixes: tuple[str, ...]) -> Callable[[str], str]:
    """A file path the command can create: not a directory, with one of `suffixes`, in an
    existing directory this process may write to.

    Args:
        suffixes: accepted extensions, e.g. (".png", ".pdf", ".svg").

    Returns:
        The `type=` function (it returns the path as given).
    """
    accepted = ", ".join(suffixes)

    def parse(text: str) -> str:
        path = Path(text)
        if not text.strip() or path.is_dir() or text.endswith(os.sep):
            example = path / f"mismatch{suffixes[0]}" if text.strip() else f"mismatch{suffixes[0]}"
            raise argparse.ArgumentTypeError(f"{_short(text)} is a directory; give a file name, e.g. {example}")
        if path.suffix.lower() not in suffixes:
            raise argparse.ArgumentTypeError(f"{_short(text)} has no accepted extension ({accepted}); e.g. "
                                             f"{path.with_suffix(suffixes[0])}")
        parent = path.parent
        if not parent.is_dir():
            raise argparse.ArgumentTypeError(f"the directory {str(parent)!r} of {_short(text)} does not exist; create it first")
        if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise argparse.ArgumentTypeError(f"{_short(text)} cannot be written (no permission); choose another path")
        return text

    return parse


steps = integer(0)
seed = integer(0, MAX_SEED)
threads = integer(1, MAX_THREADS)
plot_file = output_file((".png", ".pdf", ".svg"))


def model_or_directory(presets: tuple[str, ...]) -> Callable[[str], str]:
    """An embedded model's name, or an existing checkpoint directory (returned absolute).

    Args:
        presets: the embedded models' names.

    Returns:
        The `type=` function.
    """

    def parse(text: str) -> str:
        if text in presets:
            return text
        path = Path(text).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise argparse.ArgumentTypeError(f"{_short(text)} has no config.json; pass a Hugging Face checkpoint "
                                                 "directory (config.json and .safetensors files)")
            return str(path.resolve())
        raise argparse.ArgumentTypeError(f"expected an embedded model ({', '.join(presets)}) or a checkpoint "
                                         f"directory, got {_short(text)} (no such directory)")

    return parse


def server_url(value: str) -> str:
    """A server's base URL (`--attach`): http(s)://HOST:PORT."""
    if not value.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{value!r} is not an http(s) URL: give the server as http://HOST:PORT")
    return value.rstrip("/")

