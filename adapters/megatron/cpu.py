"""Run megatron-core on CPU (gloo): what `refit demo --trainer megatron` and the CPU tests need.

megatron-core creates tensors on `torch.cuda.current_device()`, forks the CUDA RNG tracker
around parameter initialization, and moves the last pipeline stage's copy of the embedding to
CUDA before its all-reduce with the first stage (tied output layers, MTP). On a machine without
CUDA, `megatron_on_cpu()` answers the first with the CPU, makes the second a null context and
`Tensor.cuda()` a no-op, for the duration of the block; models
must be built with `use_cpu_initialization=True` and attention called with an explicit causal
mask (Megatron builds its default mask on CUDA).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Patch the two CUDA entry points megatron-core needs, restoring them on exit.

    Raises:
        ModuleNotFoundError: megatron-core is not installed.
    """
    try:
        from megatron.core.tensor_parallel import random as mrandom
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ModuleNotFoundError("adapters.megatron.cpu needs megatron-core (the `megatron` extra)",
                                  name="megatron.core") from err
    device, fork, cuda = torch.cuda.current_device, mrandom.CudaRNGStatesTracker.fork, torch.Tensor.cuda
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    mrandom.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()  # type: ignore[method-assign]
    if not torch.cuda.is_available():
        torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.cuda.current_device = device  # type: ignore[assignment]
        mrandom.CudaRNGStatesTracker.fork = fork  # type: ignore[method-assign]
        torch.Tensor.cuda = cuda  # type: ignore[method-assign]
