"""LoRA adapters in vLLM's workers, built from tensors the trainer sends (`actor.lora.sync:
adapter`), and the handle a request names one with.

A worker builds the adapter the way vLLM's own `WorkerLoRAManager._load_adapter` builds one it
reads from disk, minus the disk: PEFTHelper from the adapter_config, `validate_legal`, then
`LoRAModel.from_lora_tensors` with the same mapper, dtype and vocabulary size, the same
validations, and the LRU adapter manager's `add_adapter` (vLLM's packing of q/k/v and gate/up, and
its one fold of lora_alpha / r into lora_B). The tensors come out of a safetensors blob, so the
worker owns them: nothing vLLM keeps or folds in place is a buffer the trainer reuses. Once the
manager holds the id, a request naming it is served from it and vLLM never reads the handle's
path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from domain.errors import AdapterUpdateFailed

# The checks `WorkerLoRAManager._load_adapter` runs on a built adapter (the set differs between vLLM
# releases: each runs where the manager has it).
VALIDATIONS = ("_validate_moe_lora_format", "_validate_modules_to_save", "_validate_token_classification_lora",
               "_validate_classification_head_lora")
# The name every rl-refit adapter is served under; the handle's path is unique per id, so vLLM's
# prefix-cache keys (the adapter's name and path) never mix two versions of it.
SERVED_NAME = "rl-refit"
STAGED_PREFIX = "rl-refit://adapter/"  # the path of an adapter rl-refit staged (never read)


@attrs.frozen
class LoraServing:
    """The adapter a request is served with: vLLM's LoRARequest, as plain values.

    Attributes:
        name: the adapter's name.
        adapter_id: vLLM's `lora_int_id`.
        path: a directory vLLM reads the adapter from, or for an adapter rl-refit staged, a key
            unique to the id (never read: the workers already hold it).
    """

    name: str
    adapter_id: int
    path: str

    @classmethod
    def staged(cls, adapter_id: int) -> LoraServing:
        return cls(SERVED_NAME, adapter_id, f"{STAGED_PREFIX}{adapter_id}")

    @classmethod
    def of(cls, value: Any) -> LoraServing | None:
        """From its plain form ([name, id, path]) or None."""
        return None if value is None else cls(str(value[0]), int(value[1]), str(value[2]))

    def to_plain(self) -> list[Any]:
        return [self.name, self.adapter_id, self.path]

    def request(self) -> Any:
        """vLLM's LoRARequest."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(self.name, self.adapter_id, self.path)


def lora_request(serving: LoraServing | None) -> Any:
    """The LoRARequest of a handle (None: the base model)."""
    return None if serving is None else serving.request()


def worker_manager(worker: Any) -> Any:
    """The worker's LRUCacheWorkerLoRAManager; AdapterUpdateFailed when vLLM runs without LoRA."""
    manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
    if manager is None:
        raise AdapterUpdateFailed("the vLLM engine was started without LoRA: start it with enable_lora=True "
                                  "(rl-refit's factory does so for actor.lora.sync=adapter)", None)
    return manager


def stage(manager: Any, adapter_id: int, config: Mapping[str, Any], blob: bytes) -> int:
    """Build the adapter under `adapter_id` in one worker's manager; returns its module count."""
    from safetensors.torch import load as load_tensors
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    adapters = manager._adapter_manager
    if adapter_id in manager.list_adapters():
        raise AdapterUpdateFailed(f"the worker already holds adapter {adapter_id}", None)
    if len(adapters) + 1 > adapters.capacity:
        raise AdapterUpdateFailed(f"the worker holds {len(adapters)} adapters, its capacity (max_cpu_loras): "
                                  "raise max_loras / max_cpu_loras", None)
    tensors = load_tensors(blob)
    peft = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    peft.validate_legal(manager.lora_config)
    model = adapters.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        lora_model_id=adapter_id, tensors=tensors, peft_helper=peft, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    lora.is_3d_lora_weight = False
    for check in VALIDATIONS:  # those of this release's _load_adapter
        validate = getattr(adapters, check, None)
        if validate is not None:
            validate(lora)
    adapters.add_adapter(lora)
    return len(lora.loras)


def drop(manager: Any, adapter_id: int) -> None:
    """Drop `adapter_id` from one worker's manager (nothing when it holds none)."""
    if adapter_id in manager.list_adapters():
        manager.remove_adapter(adapter_id)
