"""The installed Megatron-Core version, for messages and decisions."""

from __future__ import annotations

import importlib.metadata


def megatron_core_version() -> str:
    """The installed megatron-core version from the package metadata, or "unknown"."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        try:
            from megatron.core import __version__

            return str(__version__)
        except ImportError:
            return "unknown"
