"""The object a "module:qualname" path names, for the CPU emulation's kernel and wrapper tables
(cpu_emulation.py, moe_emulation.py), which name what they install by path so that vLLM is
imported only when something is installed."""

from __future__ import annotations

import importlib
from typing import Any


def resolve(path: str) -> Any:
    """The object a "module:qualname" path names (importing the module).

    Args:
        path: e.g. `adapters.vllm.fp8_block_kernel:TorchFp8BlockScaledMMKernel`.

    Returns:
        The object.
    """
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
