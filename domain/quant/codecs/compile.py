"""Which path the codec kernels run: eager (the readable reference) or compiled (the fast path).

The eager kernels are the reference. The compiled path runs the same kernel functions through
torch.compile with `fast=True`, which swaps their E2M1 encoder for `fast_elements` (float
arithmetic only: the compiled CPU code vectorizes it), over row chunks of a fixed size per row
length (`domain.quant.codecs.api`). Both give the same bytes under every element and scale rule
(tests/codecs/test_fast_path.py), and `refit bench codecs` measures both.

The path is a context variable: `use(CodecPath.COMPILED)` switches it for a block of code (the
refit quantizes inside such a block when its warm-up chose the compiled path); `set_compiled`
switches it for the whole process (the benchmark and the tests). Each kernel function gets one
`torch.compile` wrapper per process, fullgraph, with static shapes (the kernels compiled for
dynamic shapes measured several times slower): dynamo traces it once per combination of its
non-tensor arguments (format, element and scale rule, block), input dtype and chunk shape. A chunk
has a fixed number of rows for a given row length, so a shape family is one row length (plus the
shorter last chunk of a weight whose rows are not a whole number of chunks). Those combinations
can exceed dynamo's default of 8 entries per function, past which a fullgraph compile raises, so
codec calls run with a larger limit.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

# Cache entries per kernel: the rules, element types and dtypes a process uses, times the row
# lengths of one model, fit well within it.
RECOMPILE_LIMIT = 256


class CodecPath(enum.Enum):
    """How the codec kernels run."""

    EAGER = "eager"  # the readable reference: torch ops one by one, in cache-sized row chunks
    COMPILED = "compiled"  # torch.compile of the same kernels with float-only element encoders


_path: contextvars.ContextVar[CodecPath] = contextvars.ContextVar("codec_path", default=CodecPath.EAGER)


def set_compiled(enabled: bool) -> None:
    """Run codec kernels compiled (True) or eagerly (False, the default), for this context."""
    _path.set(CodecPath.COMPILED if enabled else CodecPath.EAGER)


def current() -> CodecPath:
    """The path codec calls take here."""
    return _path.get()


@contextlib.contextmanager
def use(path: CodecPath) -> Iterator[None]:
    """Run the codec calls of a block on `path`, then put the previous path back.

    Args:
        path: the path for the block.
    """
    token = _path.set(path)
    try:
        yield
    finally:
        _path.reset(token)


@functools.cache
def _compiled(fn: F) -> F:
    return torch.compile(fn, fullgraph=True, dynamic=False)  # type: ignore[return-value]


def run(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a kernel on the current path.

    Kernels take a last argument `fast` (False: the reference encoders); the compiled path passes
    True. Kernels return their block maxima instead of checking them, so that the caller's
    finiteness check is the only host synchronization.
    """
    if _path.get() is CodecPath.EAGER:
        return fn(*args)
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        return _compiled(fn)(*args, True)
