"""The real SGLang behind the SglangClient seam: `EngineClient` over a `sglang.Engine`.

sglang is imported only inside `EngineClient.launch`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from adapters.sglang.engine import NamedTensors
from adapters.sglang.profile import PINNED_SGLANG
from adapters.sglang.status import LoaderStatus
from domain.refit.storage import StorageFingerprint


def _ok(result: object) -> tuple[bool, str]:
    if result is None:
        return True, ""
    if isinstance(result, tuple):
        return bool(result[0]), str(result[1]) if len(result) > 1 else ""
    message = getattr(result, "message", None) or getattr(result, "error_message", None) or ""
    return bool(getattr(result, "success", True)), str(message)


@attrs.define
class EngineClient:
    """A real `sglang.Engine` (started with `custom_weight_loader=[LOADER_PATH]`).

    The captured-storage check runs inside the engine (the loader fails the refit); this process
    cannot see the engine's pointers, so `storage_fingerprint` is empty and `live_weights` is not
    available here.
    """

    engine: Any
    # SGLang's scheduler stops on a loader's exception: the loader reports failures here instead
    status: LoaderStatus = attrs.field(factory=lambda: LoaderStatus("the SGLang engine"))

    @classmethod
    def launch(cls, **server_kwargs: Any) -> EngineClient:
        """Start `sglang.Engine(**server_kwargs)` (see engine_args.sglang_engine_kwargs).

        Raises ModuleNotFoundError naming the adapter when sglang is not installed.
        """
        try:
            from sglang import Engine
        except ModuleNotFoundError as err:
            if err.name is None or not err.name.startswith("sglang"):
                raise
            raise ModuleNotFoundError(
                f"adapters.sglang (SglangRolloutEngine) needs sglang=={PINNED_SGLANG} "
                f"(pip install 'sglang=={PINNED_SGLANG}')", name="sglang") from err
        return cls(Engine(**server_kwargs))

    def begin_weight_update(self) -> tuple[bool, str]:
        return _ok(self.engine.begin_weight_update())

    def update_weights_from_tensor(self, named_tensors: NamedTensors, load_format: str,
                                   flush_cache: bool) -> tuple[bool, str]:
        named = self.status.outgoing(named_tensors)
        refused = self.status.refused()
        if refused is not None:
            return refused
        ok, message = _ok(self.engine.update_weights_from_tensor(named, load_format=load_format,
                                                                 flush_cache=flush_cache))
        return self.status.outcome() if ok else (ok, message)

    def end_weight_update(self) -> tuple[bool, str]:
        return _ok(self.engine.end_weight_update())

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: dict[str, torch.Tensor],
                                       config_dict: dict[str, Any]) -> tuple[bool, str]:
        return _ok(self.engine.load_lora_adapter_from_tensors(lora_name, tensors, config_dict))

    def unload_lora_adapter(self, lora_name: str) -> tuple[bool, str]:
        return _ok(self.engine.unload_lora_adapter(lora_name))

    def flush_cache(self) -> tuple[bool, str]:
        return _ok(self.engine.flush_cache())

    def storage_fingerprint(self) -> StorageFingerprint:
        return StorageFingerprint({})

    def live_weights(self) -> Mapping[str, torch.Tensor]:
        raise NotImplementedError("an out-of-process SGLang engine's tensors are not visible here")
