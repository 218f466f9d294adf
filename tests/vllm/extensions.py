"""A worker extension for the real-engine tests: rl-refit's, plus hooks that break a refit on
purpose inside the worker (a receiver that fails, one that silently corrupts, the expert redo
switched off) and one that poisons the KV-cache scales, so that the tests can show each guard
catching what it is for. Armed through `rl_refit_test_*` RPCs, one protocol request record each
(adapters.vllm.protocol), sent with the engine's workers' `call`."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch

from adapters.vllm import protocol as p
from adapters.vllm.extension import RefitWorkerExtension, serves
from adapters.vllm.worker import KV_SCALE_NAMES


@attrs.frozen
class FailReceiver(p.Request[p.Done]):
    """The receiver raises on its load number `after_loads` (0-based) of the next refit."""

    METHOD: ClassVar[str] = "rl_refit_test_fail_receiver"
    REPLY: ClassVar[type[p.Record]] = p.Done
    after_loads: int = attrs.field(converter=int)


@attrs.frozen
class Corrupt(p.Request[p.Done]):
    """Every later load multiplies the tensors whose name contains `name_part` by 2 (silently)."""

    METHOD: ClassVar[str] = "rl_refit_test_corrupt"
    REPLY: ClassVar[type[p.Record]] = p.Done
    name_part: str = attrs.field(converter=str)


@attrs.frozen
class DisableRedo(p.Request[p.Done]):
    """Stop redoing the experts' skipped post-processing (what vLLM's reload alone does)."""

    METHOD: ClassVar[str] = "rl_refit_test_disable_redo"
    REPLY: ClassVar[type[p.Record]] = p.Done


@attrs.frozen
class Name(p.Record):
    name: str = attrs.field(converter=str)


@attrs.frozen
class CorruptDeltaCopy(p.Request[Name]):
    """Flip one bit of the largest tensor in the worker's delta copy (its digest is not updated:
    what memory corruption does); replies its name."""

    METHOD: ClassVar[str] = "rl_refit_test_corrupt_delta_copy"
    REPLY: ClassVar[type[p.Record]] = Name


@attrs.frozen
class Layers(p.Record):
    count: int = attrs.field(converter=int)


@attrs.frozen
class PoisonKv(p.Request[Layers]):
    """Set every attention layer's q/k/v/prob scale buffers to `value`; replies the layers."""

    METHOD: ClassVar[str] = "rl_refit_test_poison_kv"
    REPLY: ClassVar[type[p.Record]] = Layers
    value: float = attrs.field(converter=float)


@attrs.frozen
class FailLoraStage(p.Request[p.Done]):
    """The next adapter staging on this worker fails after the adapter was built and held (the
    engine must drop it)."""

    METHOD: ClassVar[str] = "rl_refit_test_fail_lora_stage"
    REPLY: ClassVar[type[p.Record]] = p.Done


@attrs.frozen
class Ids(p.Record):
    ids: tuple[int, ...] = attrs.field(converter=lambda v: tuple(int(i) for i in v))


@attrs.frozen
class LoraIds(p.Request[Ids]):
    """The LoRA adapter ids the worker holds."""

    METHOD: ClassVar[str] = "rl_refit_test_lora_ids"
    REPLY: ClassVar[type[p.Record]] = Ids


def _no_redo(_model: torch.nn.Module, _written: Any) -> int:
    return 0


TEST_REQUESTS: tuple[type[p.Request[Any]], ...] = (FailReceiver, Corrupt, DisableRedo, CorruptDeltaCopy, PoisonKv,
                                                   FailLoraStage, LoraIds)


@serves(*TEST_REQUESTS)
class TestExtension(RefitWorkerExtension):
    """RefitWorkerExtension with test hooks."""

    def _rl_refit_test_state(self) -> dict[str, Any]:
        state = getattr(self, "_rl_refit_test", None)
        if state is None:
            state = self._rl_refit_test = {"fail_at": None, "corrupt": None, "loads": 0}
        return state

    def _rl_refit_on_test_fail_receiver(self, request: FailReceiver) -> p.Record:
        self._rl_refit_test_state().update(fail_at=request.after_loads, loads=0)
        return p.Done()

    def _rl_refit_on_test_corrupt(self, request: Corrupt) -> p.Record:
        self._rl_refit_test_state()["corrupt"] = request.name_part
        return p.Done()

    def _rl_refit_on_test_disable_redo(self, _: DisableRedo) -> p.Record:
        refit = self._rl_refit_state()
        refit.hooks = attrs.evolve(refit.hooks, redo_experts=_no_redo)
        return p.Done()

    def _rl_refit_on_test_fail_lora_stage(self, _: FailLoraStage) -> p.Record:
        self._rl_refit_test_state()["fail_lora"] = True
        self._rl_refit_test_wrap_lora_loads()
        return p.Done()

    def _rl_refit_test_wrap_lora_loads(self) -> None:
        """A server loads adapters through vLLM's own route (the worker's add_adapter from a
        directory): the armed fault fails that load before anything is held, as a broken file would."""
        from adapters.vllm.lora import worker_manager

        manager = worker_manager(self)
        if getattr(manager, "_rl_refit_test_wrapped", False):
            return
        real = manager.add_adapter

        def add_adapter(lora_request: Any) -> Any:
            if lora_request.lora_int_id not in manager.list_adapters() and self._rl_refit_test_state().pop(
                    "fail_lora", False):
                raise RuntimeError("injected adapter staging fault (tests.vllm.extensions), as the adapter loaded")
            return real(lora_request)

        manager.add_adapter = add_adapter
        manager._rl_refit_test_wrapped = True

    def _rl_refit_on_test_lora_ids(self, _: LoraIds) -> Ids:
        from adapters.vllm.lora import worker_manager

        return Ids(sorted(worker_manager(self).list_adapters()))

    def _rl_refit_on_lora_stage(self, request: p.LoraStage) -> p.LoraStaged:
        staged = super()._rl_refit_on_lora_stage(request)
        if self._rl_refit_test_state().pop("fail_lora", False):
            raise RuntimeError("injected adapter staging fault (tests.vllm.extensions), after the adapter was held")
        return staged

    def _rl_refit_on_test_poison_kv(self, request: PoisonKv) -> Layers:
        count = 0
        with torch.no_grad():
            for module in self._rl_refit_state().model.modules():
                buffers = [getattr(module, f"_{s}", None) for s in KV_SCALE_NAMES]
                if all(isinstance(b, torch.Tensor) for b in buffers):
                    for b in buffers:
                        b.fill_(float(request.value))  # type: ignore[union-attr]
                    count += 1
        return Layers(count)

    def _rl_refit_on_test_corrupt_delta_copy(self, _: CorruptDeltaCopy) -> Name:
        copy = self._rl_refit_state().delta.tensors  # type: ignore[union-attr]
        name = max(copy, key=lambda n: copy[n].numel() * copy[n].element_size())
        copy[name].reshape(-1).view(torch.uint8)[-1] ^= 1
        return Name(name)

    def _rl_refit_load_named(self, named_tensors: list[tuple[str, torch.Tensor]], retained: bool = False) -> int:
        state = self._rl_refit_test_state()
        if state["fail_at"] is not None and state["loads"] >= state["fail_at"]:
            state["fail_at"] = None
            raise RuntimeError("injected receiver fault (tests.vllm.extensions)")
        state["loads"] += 1
        if state["corrupt"] is not None:
            named_tensors = [(n, t * 2 if state["corrupt"] in n and t.dtype == torch.bfloat16 else t)
                             for n, t in named_tensors]
        return super()._rl_refit_load_named(named_tensors, retained)
