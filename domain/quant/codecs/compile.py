"""Which path the codec kernels run: eager (the readable reference), compiled, or native.

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

The native path runs a kernel's native port where one is installed (`install_native`, by the
native codecs adapter, adapters/native_codecs/) and it takes the call; every other call runs
compiled. A port returns the kernel's outputs, byte for byte, or None for a call it does not
port.
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
    NATIVE = "native"  # the kernels' native ports where installed, else compiled


_path: contextvars.ContextVar[CodecPath] = contextvars.ContextVar("codec_path", default=CodecPath.EAGER)
# kernel function -> its native port: (the kernel's arguments, without `fast`) -> its outputs, or None
_native: dict[Callable[..., Any], Callable[..., Any]] = {}


def install_native(kernel: Callable[..., Any], port: Callable[..., Any]) -> None:
    """Install `port` as `kernel`'s native port (the native path calls it first).

    Args:
        kernel: a codec kernel function (e.g. domain.quant.codecs.fp8_block._quantize_kernel).
        port: called with the kernel's arguments but `fast`; returns the kernel's outputs, or None
            for a call it does not port.
    """
    _native[kernel] = port


def native_kernels() -> tuple[str, ...]:
    """The kernels that have a native port installed, by qualified name."""
    return tuple(f"{k.__module__}.{k.__qualname__}" for k in _native)


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


def run_small(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a kernel too small to be worth compiling (one reduction): its native port on the native
    path where it takes the call, else the kernel itself, eagerly."""
    if _path.get() is CodecPath.NATIVE and (port := _native.get(fn)) is not None:
        out = port(*args)
        if out is not None:
            return out
    return fn(*args)


@functools.cache
def _compiled(fn: F) -> F:
    return torch.compile(fn, fullgraph=True, dynamic=False)  # type: ignore[return-value]


def run(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a kernel on the current path.

    Kernels take a last argument `fast` (False: the reference encoders); the compiled path passes
    True. Kernels return their block maxima instead of checking them, so that the caller's
    finiteness check is the only host synchronization.
    """
    path = _path.get()
    if path is CodecPath.EAGER:
        return fn(*args)
    if path is CodecPath.NATIVE and (port := _native.get(fn)) is not None:
        out = port(*args)
        if out is not None:
            return out
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        return _compiled(fn)(*args, True)
