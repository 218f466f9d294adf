"""Optional torch.compile of the codec kernels.

The eager kernels are the readable reference; compiled ones are bit-identical to them under every
element and scale rule (tests/codecs/test_compiled.py), and `refit bench codecs` measures both.
Compilation is off by default; `set_compiled(True)` switches it on for the process (the
benchmark and the tests do; nothing else does). Each kernel function gets one `torch.compile`
wrapper per process (fullgraph); dynamo traces it again for each new combination of its
non-tensor arguments (format, element and scale rule, block), input dtype and shape (marking
shapes dynamic after the first change). Those combinations are few but more than dynamo's default
of 8 entries per function, past which a fullgraph compile raises, so codec calls run with a
larger limit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

# Cache entries per kernel: 2 element rules x 2 MX scale rules x 2 element types x 3 dtypes, each
# with a static and a dynamic shape, fit well within it.
RECOMPILE_LIMIT = 64

_enabled = False


def set_compiled(enabled: bool) -> None:
    """Run codec kernels through torch.compile (True) or eagerly (False, the default)."""
    global _enabled
    _enabled = bool(enabled)


@functools.cache
def _compiled(fn: F) -> F:
    return torch.compile(fn, fullgraph=True)  # type: ignore[return-value]


def run(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a kernel, compiled or eager per the switch.

    Kernels return their block maxima instead of checking them, so that the caller's finiteness
    check is the only host synchronization.
    """
    if not _enabled:
        return fn(*args)
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        return _compiled(fn)(*args)
