"""SGLang's `MultiprocessingSerializer` (sglang/srt/utils/common.py, SGLang 0.5.23), ported so that
the trainer can talk to an SGLang server without importing sglang.

What `/update_weights_from_tensor` carries is not tensor bytes: it is, per TP rank, a base64
string of a `ForkingPickler` pickle of `[(name, tensor), ...]`, whose tensors are torch.multiprocessing
handles to memory the sender shares:

- a CPU tensor: the name of a shared-memory segment (torch's `file_system` strategy: a file in
  /dev/shm that any process of the same user on this host can map). The default `file_descriptor`
  strategy cannot cross to an unrelated process (its descriptor travels through a socket guarded
  by the sending process tree's authkey), so `serialize` uses `file_system` for storages, whatever
  the process-wide strategy is, without changing it;
- a CUDA tensor: a CUDA IPC handle, with the device written as its UUID, as SGLang's own
  `_reduce_tensor_modified` (sglang/srt/utils/patch_torch.py) writes it, so the server finds the
  device whatever its CUDA_VISIBLE_DEVICES.

So the server must run on the same host, as the same user (docs/attach.md). `deserialize` is
SGLang's receiving side: base64, then its `SafeUnpickler` with the allow-list below (the entries a
tensor or storage pickle uses), which the tests' SGLang-shaped server uses exactly as SGLang does.
"""

from __future__ import annotations

import base64
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.multiprocessing import reductions

NamedTensors = list[tuple[str, torch.Tensor]]

# The index of the device in a CUDA tensor's reduce args (SGLang's _REDUCE_TENSOR_ARG_DEVICE_INDEX).
_CUDA_DEVICE_ARG = 6


def _reduce_storage_shared_file(storage: torch.UntypedStorage) -> tuple[Any, ...]:
    """torch's `reduce_storage` under the file_system strategy, literally (torch 2.x)."""
    if storage.device.type != "cpu":
        return reductions.reduce_storage(storage)  # CUDA storages travel inside their tensor's handle
    metadata = storage._share_filename_cpu_()
    cache_key = metadata[1]
    storage._shared_incref()  # the receiver's rebuild decrefs it
    reductions.shared_cache[cache_key] = reductions.StorageWeakRef(storage)
    return (reductions.rebuild_storage_filename, (type(storage), *metadata))


def _reduce_tensor(tensor: torch.Tensor) -> tuple[Any, ...]:
    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:  # SGLang's _device_to_uuid
        device = args[_CUDA_DEVICE_ARG]
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        args = (*args[:_CUDA_DEVICE_ARG], uuid, *args[_CUDA_DEVICE_ARG + 1:])
    return rebuild, args


class _Pickler(ForkingPickler):
    """ForkingPickler with the two reductions above for this pickle only."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        table = dict(self.dispatch_table)
        table[torch.UntypedStorage] = _reduce_storage_shared_file
        table[torch.Tensor] = _reduce_tensor
        table[torch.nn.Parameter] = _reduce_tensor
        self.dispatch_table = table


def serialize(named: NamedTensors) -> str:
    """One rank's `serialized_named_tensors` entry: base64 of the pickle (output_str=True)."""
    buf = io.BytesIO()
    _Pickler(buf).dump([(name, t.detach()) for name, t in named])
    return base64.b64encode(buf.getvalue()).decode("utf-8")


# SGLang's SafeUnpickler.ALLOWED_GLOBALS: the entries a pickle of named tensors can reach.
ALLOWED_GLOBALS = frozenset({
    ("builtins", "list"), ("builtins", "tuple"), ("builtins", "dict"), ("builtins", "str"),
    ("builtins", "int"), ("builtins", "bool"), ("collections", "OrderedDict"),
    ("torch", "Tensor"), ("torch", "Size"), ("torch", "device"), ("torch", "dtype"),
    ("torch.nn.parameter", "Parameter"),
    ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage_child"),
    ("multiprocessing.resource_sharer", "DupFd"),
} | {("torch", str(d).removeprefix("torch.")) for d in (
    torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.float8_e8m0fnu, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool)})


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """SGLang's _rebuild_cuda_tensor_modified: the device may come as its UUID."""
    device = args[_CUDA_DEVICE_ARG]
    if isinstance(device, str):
        found = [i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == device]
        if not found:
            raise RuntimeError(f"Invalid device_uuid={device}")
        args = (*args[:_CUDA_DEVICE_ARG], found[0], *args[_CUDA_DEVICE_ARG + 1:])
    return reductions.rebuild_cuda_tensor(*args)


class SafeUnpickler(pickle.Unpickler):
    """SGLang's SafeUnpickler: a global outside the allow-list is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor  # what SGLang's monkey_patch_torch_reductions installs
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def deserialize(data: str | bytes) -> Any:
    """SGLang's MultiprocessingSerializer.deserialize (base64 text or raw pickle bytes)."""
    if isinstance(data, str):
        data = base64.b64decode(data, validate=True)
    return SafeUnpickler(io.BytesIO(data)).load()
