"""The worker extension of `refit bench engine`: rl-refit's, plus the two baselines the bench
measures inside the same engine (vLLM imports this module inside its workers, by name).

Both are protocol RPCs, with their records in adapters.vllm.protocol:

- `BenchReload(path)` (`rl_refit_bench_reload`): vLLM's own `Worker.reload_weights(weights_path=path,
  is_checkpoint_format=True)`, the way to refit a vLLM engine from a checkpoint on disk.
- `BenchMode("layerwise")` (`rl_refit_bench_mode`): until set back to `"refit"`, the refit steps are
  vLLM's own reload of the buckets and nothing else: `initialize_layerwise_reload` at begin,
  `model.load_weights` per bucket, `finalize_layerwise_reload` at finalize, what vLLM's
  `reload_weights(weights_iterator=...)` does with the same tensors. It serves the right weights;
  what it leaves out is rl-refit's own work in the worker (the expert redo, the written-parameter
  audit, the tied head's processing, the KV-scale reset). The floor of vLLM's loading and
  processing, through the same buckets and transport.
- `BenchMode("receive")`: the refit steps receive the buckets and drop them: with the trainer's
  quantizing and packing, the floor of the trainer's side and the transport (disaggregated: the
  side group's stream; colocated: the hand-over).
- `BenchMode("load_weights")`: the refit steps skip vLLM's layerwise reload and hand each bucket's
  tensors straight to `model.load_weights`. That is only a timing baseline: without the layerwise
  reload, a loader writes into parameters that vLLM has already processed into kernel format (on
  CPU a dense weight is an empty tensor beside a packed kernel handle), so what the engine serves
  afterwards is wrong.

Each floor copies a bucket's tensors exactly when the refit does: when they are not retained.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from adapters.vllm import protocol as p
from adapters.vllm.extension import RefitWorkerExtension, serves
from adapters.vllm.protocol import BenchMode, BenchReload, Seconds

MODES = ("refit", "layerwise", "load_weights", "receive")


@serves(*p.BENCH_REQUESTS)
class BenchExtension(RefitWorkerExtension):
    """RefitWorkerExtension with the bench's baselines (`self` is vLLM's worker)."""

    def _rl_refit_bench_mode(self) -> str:
        return str(getattr(self, "_rl_refit_bench", "refit"))

    def _rl_refit_on_bench_reload(self, request: BenchReload) -> Seconds:
        return Seconds(self._rl_refit_bench_reload(request.path))

    def _rl_refit_on_bench_mode(self, request: BenchMode) -> p.Record:
        """How the next refits load: `refit` (rl-refit's WorkerRefit) or `load_weights` (the baseline).

        Entering `load_weights` sets the engine's processed tensors aside and gives every layer
        fresh checkpoint-format parameters with their loaders (what the model holds between
        vLLM's `create_weights` and its processing), so that `model.load_weights` has somewhere
        to write; leaving it puts the processed tensors back, untouched. Neither is timed.
        """
        mode = request.mode
        if mode not in MODES:
            raise ValueError(f"bench mode {mode!r} is not one of {', '.join(MODES)}")
        if mode == self._rl_refit_bench_mode():
            return p.Done()
        if self._rl_refit_bench_mode() == "load_weights":
            kept: Kept = getattr(self, "_rl_refit_bench_kept", [])
            _put_back(kept)
        self._rl_refit_bench_kept: Kept = (_checkpoint_format(self._rl_refit_state().model) if mode == "load_weights"
                                           else [])
        self._rl_refit_bench = mode
        return p.Done()

    def _rl_refit_bench_reload(self, path: str) -> float:
        """vLLM's `reload_weights` from the checkpoint directory `path`; returns its seconds.

        An engine started with `load_format: dummy` has a loader that cannot read files, so the
        checkpoint's format is set for the call; the model path vLLM points at `path` is put back.
        """
        load_config = self.vllm_config.load_config  # type: ignore[attr-defined]
        model_config = self.vllm_config.model_config  # type: ignore[attr-defined]
        kept = (load_config.load_format, model_config.model, model_config.model_weights, model_config.revision)
        if load_config.load_format == "dummy":
            load_config.load_format = "safetensors"
        t0 = time.perf_counter()
        try:
            self.reload_weights(weights_path=str(path), is_checkpoint_format=True)  # type: ignore[attr-defined]
        finally:
            load_config.load_format, model_config.model, model_config.model_weights, model_config.revision = kept
        return time.perf_counter() - t0

    # --- the floors: vLLM's layerwise reload alone, per-bucket load_weights, the buckets dropped ----

    def _rl_refit_on_begin(self, request: p.Begin) -> p.Record:
        mode = self._rl_refit_bench_mode()
        if mode == "refit":
            return super()._rl_refit_on_begin(request)
        if mode == "layerwise":
            state = self._rl_refit_state()
            with self._rl_refit_context():
                state.hooks.initialize_reload(state.model)
        self._rl_refit_bench_loaded = 0
        return p.Done()

    def _rl_refit_load_named(self, named_tensors: list[tuple[str, torch.Tensor]], retained: bool = False) -> int:
        if self._rl_refit_bench_mode() == "refit":
            return super()._rl_refit_load_named(named_tensors, retained)
        if self._rl_refit_bench_mode() == "receive":
            self._rl_refit_bench_loaded = int(getattr(self, "_rl_refit_bench_loaded", 0)) + len(named_tensors)
            return len(named_tensors)
        state = self._rl_refit_state()
        owned = state.owned(named_tensors, retained)  # copied exactly when the refit copies
        with torch.no_grad(), state.hooks.load_context():
            state.model.load_weights(owned)  # type: ignore[operator]
        self._rl_refit_bench_loaded = int(getattr(self, "_rl_refit_bench_loaded", 0)) + len(owned)
        return len(owned)

    def _rl_refit_on_finalize(self, request: p.Finalize) -> p.FinalizeReply:
        mode = self._rl_refit_bench_mode()
        if mode == "refit":
            return super()._rl_refit_on_finalize(request)
        t0 = time.perf_counter()
        if mode == "layerwise":
            self._rl_refit_bench_end_reload()
        return p.FinalizeReply(0, time.perf_counter() - t0, int(getattr(self, "_rl_refit_bench_loaded", 0)))

    def _rl_refit_on_abort(self, request: p.Abort) -> p.Record:
        mode = self._rl_refit_bench_mode()
        if mode == "refit":
            return super()._rl_refit_on_abort(request)
        if mode == "layerwise":
            self._rl_refit_bench_end_reload()
        return p.Done()

    def _rl_refit_bench_end_reload(self) -> None:
        """The layerwise floor's end, after its last bucket or a failure: vLLM's own finalize."""
        state = self._rl_refit_state()
        with self._rl_refit_context():
            state.hooks.finalize_reload(state.model, state.model_config)


# (layer, its parameters, its buffers, its non-persistent buffer names), exactly as they were
Kept = list[tuple[torch.nn.Module, dict[str, Any], dict[str, Any], set[str]]]


def _checkpoint_format(model: torch.nn.Module) -> Kept:
    """Set every layer's tensors aside and give it empty checkpoint-format tensors, from the
    metadata vLLM recorded at load time for its layerwise reload; returns what was set aside."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta

    kept: Kept = []
    for layer in model.modules():
        kept.append((layer, dict(layer._parameters), dict(layer._buffers), set(layer._non_persistent_buffers_set)))
        info = get_layerwise_info(layer)
        restore_layer_on_meta(layer, info)
        materialize_layer(layer, info)
        for t in [*layer._parameters.values(), *layer._buffers.values()]:
            loader = getattr(t, "weight_loader", None)
            while loader is not None and getattr(loader, "__name__", "") == "online_process_loader":
                loader = loader.__wrapped__  # a wrapper left on vLLM's metadata by an earlier reload
            if loader is not None:
                t.weight_loader = loader  # type: ignore[union-attr]
    return kept


def _put_back(kept: Kept) -> None:
    """Give every layer back exactly the tensors `_checkpoint_format` set aside."""
    for layer, params, buffers, non_persistent in kept:
        layer._parameters = dict(params)
        layer._buffers = dict(buffers)
        layer._non_persistent_buffers_set = set(non_persistent)
