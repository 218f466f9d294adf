"""vLLM's own ways in, as `refit bench engine` measures a refit against them (the plugin's
`bench`, adapters.engine_plugin.EngineBaselines; docs/benchmarks.md).

The engine starts with adapters.vllm.bench_extension.BenchExtension, whose two protocol
requests carry the baselines: `BenchReload(path)`, vLLM's `Worker.reload_weights` from a
checkpoint directory, and `BenchMode(mode)`, how the next refits load (rl-refit's refit, vLLM's
layerwise reload alone, per-bucket `model.load_weights`, or the buckets dropped). This module
imports neither vLLM nor the protocol until a baseline runs, so that reading the plugin table
costs nothing.
"""

from __future__ import annotations

from typing import Any

from adapters.engine_plugin import EngineBaselines
from adapters.vllm.config import PYTHON_VAR


def _workers(engine: Any) -> Any:
    """The engine's workers, which answer the bench extension's requests (adapters.vllm.protocol)."""
    from adapters.vllm.protocol import WorkerRpc

    workers = getattr(engine, "workers", None)
    if not isinstance(workers, WorkerRpc):
        raise TypeError(f"refit bench engine measures a vLLM engine whose workers answer protocol requests, got "
                        f"{type(engine).__name__}")
    return workers


def reload(engine: Any, directory: str) -> None:
    """vLLM's own `reload_weights` of the checkpoint in `directory`, in every worker."""
    from adapters.vllm.protocol import BenchReload

    _workers(engine).call(BenchReload(directory))


def mode(engine: Any, name: str) -> None:
    """How the next refits load in every worker (adapters.vllm.bench_extension.MODES)."""
    from adapters.vllm.protocol import BenchMode

    _workers(engine).call(BenchMode(name))


BASELINES = EngineBaselines(
    name="vLLM",
    extension="adapters.vllm.bench_extension.BenchExtension",
    # what vLLM's CPU build serves, dense and MoE, on any x86-64 CPU (the matmul emulated where the
    # CPU has no kernel: adapters.vllm.cpu_emulation)
    presets=("BF16", "FP8_BLOCK", "MXFP8"),
    reload=reload,
    mode=mode,
    stream=lambda engine: engine.workers,  # VllmRolloutEngine.workers: begin, load, finalize
    here=("run it with the vLLM environment's python (.venv-vllm/bin/python -m app.cli.main bench engine), "
          "or deploy it disaggregated"),
    setup=(f"set {PYTHON_VAR} to the vLLM environment's python, create .venv-vllm (scripts/setup-vllm-env.sh), "
           "or run the bench with that python (colocated)"),
    labels={
        "reload": "vLLM reload_weights from disk (checkpoint already written)",
        "layerwise": "vLLM layerwise reload of the same buckets, nothing else (loading + processing floor)",
        "write_reload": "write checkpoint + vLLM reload_weights",
        "load_weights": "per-bucket model.load_weights, unprocessed (timing floor only: serves wrong weights)",
    },
    terms={
        "reload": "vLLM's reload_weights",
        "layerwise": "vLLM's layerwise reload of the same buckets",
        "load": "vLLM's load_weights",
        "processing": "vLLM's processing",
        "loading": "vLLM's loading and processing",
        "server": "the vLLM server",
    },
    notes={
        "start_colocated": "`LLM(...)` in this process, vLLM already imported",
        "start_disaggregated": "the vLLM server rl-refit starts, until `/health` answers: Python, vLLM's import, "
                               "the engine's start",
        "threads": "vLLM's multiprocess engine busy-polls for 1 s after every call; an OpenMP team over every core "
                   "beside it stalls at each barrier",
        "load_weights": "on CPU dense weights are packed kernel handles and FP8 weights are processed",
        "layerwise_differs": "expected where rl-refit redoes what the reload skips: BF16 MoE experts on CPU, a tied "
                             "head",
        "reload_differs_bf16": "expected for BF16 MoE on CPU: vLLM's reload copies plain expert weights into storage "
                               "its MoE kernel reads as prepacked tiles and skips the prepack on a weight update, so it "
                               "serves other weights; rl-refit's refit redoes the prepack, "
                               "docs/engines.md#bf16-moe-on-vllm",
        "transport_key": "rollout.engine_kwargs.vllm.transport",
    },
)
