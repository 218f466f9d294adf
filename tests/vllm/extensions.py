"""A worker extension for the real-engine tests: rl-refit's, plus hooks that break a refit on
purpose inside the worker (a receiver that fails, one that silently corrupts, the expert redo
switched off) and one that poisons the KV-cache scales, so that the tests can show each guard
catching what it is for. Armed through `rl_refit_test_*` methods (collective_rpc by name)."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from adapters.vllm.extension import RefitWorkerExtension
from adapters.vllm.worker import KV_SCALE_NAMES


def _no_redo(_model: torch.nn.Module, _written: Any) -> int:
    return 0


class TestExtension(RefitWorkerExtension):
    """RefitWorkerExtension with test hooks."""

    def _rl_refit_test_state(self) -> dict[str, Any]:
        state = getattr(self, "_rl_refit_test", None)
        if state is None:
            state = self._rl_refit_test = {"fail_at": None, "corrupt": None, "loads": 0}
        return state

    def rl_refit_test_fail_receiver(self, after_loads: int) -> None:
        """The receiver raises on its load number `after_loads` (0-based) of the next refit."""
        state = self._rl_refit_test_state()
        state.update(fail_at=int(after_loads), loads=0)

    def rl_refit_test_corrupt(self, name_part: str) -> None:
        """Every later load multiplies the tensors whose name contains `name_part` by 2 (silently)."""
        self._rl_refit_test_state()["corrupt"] = str(name_part)

    def rl_refit_test_disable_redo(self) -> None:
        """Stop redoing the experts' skipped post-processing (what vLLM's reload alone does)."""
        refit = self._rl_refit_state()
        refit.hooks = attrs.evolve(refit.hooks, redo_experts=_no_redo)

    def rl_refit_test_poison_kv(self, value: float) -> int:
        """Set every attention layer's q/k/v/prob scale buffers to `value`; returns the layers."""
        count = 0
        with torch.no_grad():
            for module in self._rl_refit_state().model.modules():
                buffers = [getattr(module, f"_{s}", None) for s in KV_SCALE_NAMES]
                if all(isinstance(b, torch.Tensor) for b in buffers):
                    for b in buffers:
                        b.fill_(float(value))  # type: ignore[union-attr]
                    count += 1
        return count

    def rl_refit_test_corrupt_delta_copy(self) -> str:
        """Flip one bit of the largest tensor in the worker's delta copy (its digest is not updated:
        what memory corruption does); returns its name."""
        copy = self._rl_refit_state().delta.tensors  # type: ignore[union-attr]
        name = max(copy, key=lambda n: copy[n].numel() * copy[n].element_size())
        copy[name].reshape(-1).view(torch.uint8)[-1] ^= 1
        return name

    def _rl_refit_load_named(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        state = self._rl_refit_test_state()
        if state["fail_at"] is not None and state["loads"] >= state["fail_at"]:
            state["fail_at"] = None
            raise RuntimeError("injected receiver fault (tests.vllm.extensions)")
        state["loads"] += 1
        if state["corrupt"] is not None:
            named_tensors = [(n, t * 2 if state["corrupt"] in n and t.dtype == torch.bfloat16 else t)
                             for n, t in named_tensors]
        return super()._rl_refit_load_named(named_tensors)
