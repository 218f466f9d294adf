"""An instrumented device for CPU tests: tensors that say they live on `cuda:0`, and a mode that
fails where a real GPU would (or where a GPU path would cross the host).

`FakeCuda()` is a context manager (a TorchFunctionMode, entered per thread). Inside it:

- a tensor created with `device="cuda..."`, or moved there (`.to`, `.cuda`), is a CPU tensor of the
  `OnFakeCuda` subclass, whose `.device` says `cuda:0`; operations on it give `OnFakeCuda` results;
- an operation that mixes an `OnFakeCuda` tensor with a host tensor of one element or more (other
  than a copy between them, which is a transfer) raises `DeviceMistake`, as CUDA does;
- `.numpy()` of an `OnFakeCuda` tensor raises `DeviceMistake`;
- a host buffer of `HOST_BUFFER_BYTES` or more created by a factory (empty, zeros, ...) or by a
  copy of a GPU tensor to the host raises
  `DeviceMistake` unless `host_buffers` allows it (`frombuffer` of Python bytes makes none): "forbid" (nothing of the refit may cross the
  host), "pinned" (only pinned ones: `pin_memory=True`), "allow";
- `torch.cuda.current_stream(...).synchronize()` and `torch.cuda.synchronize()` are counted in
  `synchronized` instead of reaching a driver.

`require_on_device(t, where)` is what a collective of a GPU backend (NCCL) demands of its tensors.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

FAKE = torch.device("cuda", 0)
HOST_BUFFER_BYTES = 4096
_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.randint, torch.rand, torch.randn, torch.arange,
              torch.tensor, torch.empty_strided}
_LIKE = {torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like, torch.randn_like}
_TRANSFERS = {torch.Tensor.copy_, torch.Tensor.__setitem__}


class DeviceMistake(AssertionError):
    """A tensor on the wrong device: the GPU would fail here, or the stream crossed the host."""


class OnFakeCuda(torch.Tensor):
    """A CPU tensor that says it lives on `cuda:0` (only inside `FakeCuda`)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # the mode does all the work

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return FAKE

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


class Pinned(torch.Tensor):
    """A CPU tensor created with pin_memory=True (only inside `FakeCuda`)."""

    __torch_function__ = torch._C._disabled_torch_function_impl


def on_fake(t: torch.Tensor) -> bool:
    return isinstance(t, OnFakeCuda)


def require_on_device(t: torch.Tensor, where: str) -> None:
    if not on_fake(t):
        raise DeviceMistake(f"{where}: a host tensor {tuple(t.shape)} reached a collective of the GPU transport")


def _wants_cuda(device: Any) -> bool | None:
    if device is None:
        return None
    if isinstance(device, int):
        return True
    return torch.device(device).type == "cuda"


def _plain(t: torch.Tensor) -> torch.Tensor:
    return torch.Tensor._make_subclass(torch.Tensor, t) if type(t) is not torch.Tensor else t  # type: ignore[arg-type]


def _as(cls: type, t: Any) -> Any:
    if not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter):
        return t
    return t if type(t) is cls else torch.Tensor._make_subclass(cls, t, t.requires_grad)


class _Stream:
    """torch.cuda's stream inside FakeCuda: a wait counts in this thread's mode."""

    def synchronize(self) -> None:
        mode = getattr(_ACTIVE, "mode", None)
        if mode is None:
            raise DeviceMistake("a CUDA stream was used outside FakeCuda")
        mode.synchronized += 1


_ACTIVE = threading.local()  # this thread's FakeCuda (modes are per thread; torch.cuda is patched once)
_PATCH_LOCK = threading.Lock()
_PATCHED: list[Any] = []  # [MonkeyPatch, users]


class FakeCuda(TorchFunctionMode):
    """See the module docstring.

    Args:
        host_buffers: "forbid", "pinned" or "allow" (host buffers of HOST_BUFFER_BYTES or more).
    """

    def __init__(self, host_buffers: str = "forbid") -> None:
        super().__init__()
        self.host_buffers = host_buffers
        self.synchronized = 0
        self.host_created: list[tuple[str, int, bool]] = []

    def __enter__(self) -> FakeCuda:
        with _PATCH_LOCK:
            if not _PATCHED:
                import pytest

                mp = pytest.MonkeyPatch()
                mp.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
                mp.setattr(torch.cuda, "synchronize", lambda device=None: _Stream().synchronize())
                _PATCHED[:] = [mp, 0]
            _PATCHED[1] += 1
        self._outer = getattr(_ACTIVE, "mode", None)
        _ACTIVE.mode = self
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        _ACTIVE.mode = self._outer
        with _PATCH_LOCK:
            _PATCHED[1] -= 1
            if not _PATCHED[1]:
                _PATCHED[0].undo()
                _PATCHED.clear()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        fake_in = any(on_fake(t) for t in tensors)
        name = getattr(func, "__name__", str(func))
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
            out = self._move(func, args, kwargs)
            if on_fake(args[0]) and not on_fake(out):
                self._host_buffer(name, out.numel() * out.element_size(), False)
            return out
        if func is torch.Tensor.numpy and fake_in:
            raise DeviceMistake("numpy() of a tensor on the GPU: copy it to the host first (or keep the work on the GPU)")
        if func is torch.Tensor.is_pinned:
            return isinstance(args[0], Pinned)
        if fake_in and func not in _TRANSFERS:
            host = [t for t in tensors if not on_fake(t) and t.dim() > 0]
            if host:
                raise DeviceMistake(f"{name} mixes a GPU tensor with a host tensor {tuple(host[0].shape)}")
        if func in _FACTORIES or func in _LIKE or func is torch.frombuffer:
            return self._create(func, args, kwargs, fake_in)
        out = func(*tree_map(lambda t: _plain(t) if isinstance(t, torch.Tensor) else t, args),
                   **tree_map(lambda t: _plain(t) if isinstance(t, torch.Tensor) else t, kwargs))
        if func in _TRANSFERS:
            return args[0] if func is torch.Tensor.copy_ else out
        if fake_in and func is not torch.Tensor.tolist:
            return tree_map(lambda t: _as(OnFakeCuda, t), out)
        if tensors and isinstance(tensors[0], Pinned) and func in (torch.Tensor.__getitem__, torch.Tensor.view,
                                                                    torch.Tensor.reshape):
            return _as(Pinned, out)
        return out

    def _create(self, func: Any, args: tuple, kwargs: dict, fake_in: bool) -> Any:
        cuda = _wants_cuda(kwargs.get("device"))
        if func in _LIKE and cuda is None:
            cuda = fake_in
        pinned = bool(kwargs.pop("pin_memory", False))
        kwargs.pop("device", None)
        out = func(*tree_map(lambda t: _plain(t) if isinstance(t, torch.Tensor) else t, args), **kwargs)
        if cuda:
            return _as(OnFakeCuda, out)
        nbytes = out.numel() * out.element_size()
        if func is torch.frombuffer:  # Python bytes (a frame's metadata) seen as a tensor: no buffer is made
            return out
        self._host_buffer(getattr(func, "__name__", str(func)), nbytes, pinned)
        return _as(Pinned, out) if pinned else out

    def _host_buffer(self, name: str, nbytes: int, pinned: bool) -> None:
        """A host tensor was made (a factory, or a copy of a GPU tensor): allowed or not."""
        self.host_created.append((name, nbytes, pinned))
        if nbytes >= HOST_BUFFER_BYTES and not (self.host_buffers == "allow" or (self.host_buffers == "pinned" and pinned)):
            what = "an unpinned host buffer" if self.host_buffers == "pinned" else "a host buffer"
            raise DeviceMistake(f"{name} made {what} of {nbytes} bytes on a GPU path")

    @staticmethod
    def _move(func: Any, args: tuple, kwargs: dict) -> Any:
        t, rest = args[0], args[1:]
        if func is torch.Tensor.cuda:
            cuda = True
        elif func is torch.Tensor.cpu:
            cuda = False
        else:
            target = kwargs.pop("device", None)
            for a in rest:
                if isinstance(a, (str, torch.device, int)):
                    target = a
                elif isinstance(a, torch.dtype):
                    kwargs["dtype"] = a
                elif isinstance(a, torch.Tensor):
                    target = a.device
            cuda = _wants_cuda(target) if target is not None else on_fake(t)
        kwargs.pop("non_blocking", None)
        kwargs.pop("copy", None)
        dtype = kwargs.pop("dtype", None)
        plain = _plain(t)
        out = plain.to(dtype) if dtype is not None else plain
        if cuda and not on_fake(t):
            return _as(OnFakeCuda, out.clone())
        if not cuda and on_fake(t):
            return out.clone()
        return _as(type(t), out) if out is not plain else t
