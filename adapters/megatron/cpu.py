"""Run megatron-core on CPU (gloo): what `refit demo megatron` and the CPU tests need.

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
from typing import Any

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
    cuda_module: Any = torch.cuda
    tensor: Any = torch.Tensor
    device, fork, to_cuda = cuda_module.current_device, mrandom.CudaRNGStatesTracker.fork, tensor.cuda
    cuda_module.current_device = lambda: torch.device("cpu")
    mrandom.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()
    if not torch.cuda.is_available():
        tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        cuda_module.current_device = device
        mrandom.CudaRNGStatesTracker.fork = fork
        tensor.cuda = to_cuda
