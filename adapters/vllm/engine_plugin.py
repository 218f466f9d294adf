"""The vLLM engine as a plugin (adapters.engine_plugin): its profile, its configuration section,
and how it is built in each deployment: in this process (colocated), as a server of its own
(disaggregated), or over a server the user started (attached; docs/attach.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from adapters.engine_plugin import (
    ATTACHED,
    COLOCATED,
    DISAGGREGATED,
    DemoDefaults,
    EngineBaselines,
    EngineHost,
    EnginePlugin,
    EngineRequest,
    WorkerSide,
)
from adapters.vllm.config import PYTHON_VAR, VllmEngineConfig
from adapters.vllm.profile import VLLM

if TYPE_CHECKING:
    from adapters.engine_start import EngineStart
    from adapters.vllm.cold_start import ColdProcess
    from adapters.vllm.engine import VllmRolloutEngine
    from adapters.vllm.launcher import ColdServer


def build(request: EngineRequest) -> VllmRolloutEngine:
    """The vLLM engine of one request: attached to `url` (or `urls[replica]`), else started."""
    section: VllmEngineConfig = request.section
    if request.deployment == ATTACHED:
        from adapters.vllm.factory import attach_vllm_engine

        url = section.attached_url(request.replica)
        return attach_vllm_engine(section, request.start(), request.host, url)
    from adapters.vllm.factory import build_vllm_engine

    return build_vllm_engine(section, request.start(), request.host, deployment=request.deployment,
                             commit_mode=request.commit_mode, lora_rank=request.lora_rank)


def cold_start(section: VllmEngineConfig, start: EngineStart, host: EngineHost,
               directory: str) -> ColdProcess | ColdServer:
    """vLLM started cold from a checkpoint directory (adapters.vllm.factory.vllm_cold_start)."""
    from adapters.vllm.factory import vllm_cold_start

    return vllm_cold_start(section, start, host, directory)


def server_python(section: VllmEngineConfig, host: EngineHost) -> str:
    """The interpreter of rl-refit's vLLM servers: rollout.engine_kwargs.vllm.python, else
    RL_REFIT_VLLM_PYTHON, else a .venv-vllm, else this one (adapters.vllm.interpreter)."""
    from adapters.vllm.interpreter import configured_python, vllm_python

    return vllm_python(configured_python(section.python, host.honoured.get(PYTHON_VAR)))


def probe(section: VllmEngineConfig, host: EngineHost) -> Mapping[str, Any]:
    """What `refit doctor` asks vLLM's environment about: its interpreter (None: no vLLM to ask)
    and the CPU emulation mode."""
    import importlib.util
    import sys

    python: str | None = server_python(section, host)
    if python == sys.executable and importlib.util.find_spec("vllm") is None:
        python = None  # no vLLM environment to ask
    return {"vllm_python": python, "cpu_emulation": section.cpu_emulation}


def demo_section(url: str | None, own_checkpoint: bool) -> VllmEngineConfig:
    """The demos' vLLM engine: a tiny model with no tokenizer, eager, 128 tokens; on a machine
    without CUDA, 1 GiB of KV cache in host memory. A checkpoint of the user's starts with dummy
    weights, as the embedded model does, so the first refit writes every weight."""
    import torch

    engine_args: dict[str, object] = {"skip_tokenizer_init": True, "dtype": "bfloat16", "enforce_eager": True,
                                      "max_model_len": 128, "seed": 0}
    if own_checkpoint:
        engine_args["load_format"] = "dummy"
    return VllmEngineConfig(engine_args=engine_args,
                            environment={} if torch.cuda.is_available() else {"VLLM_CPU_KVCACHE_SPACE": "1"},
                            url=url)


def baselines() -> EngineBaselines:
    """vLLM's own ways in, for `refit bench engine` (adapters.vllm.bench)."""
    from adapters.vllm.bench import BASELINES

    return BASELINES


# What the demos run on vLLM's CPU build: FP8_BLOCK (dense and MoE) and MXFP8 on its own kernels;
# the 4-bit formats on the experts alone, as the seed's runs serve them (vLLM serves no per-token
# NVFP4 Linear layer); LoRA on its BF16 kernels. An engine in this process (colocated) owns the
# process's state for the process's life.
DEMO = DemoDefaults(
    demo_section, preset="FP8_BLOCK", model="micro-moe", mismatch_presets=("BF16", "FP8_BLOCK", "MXFP8"),
    qat_roles={"FP8_BLOCK": ("FP8_BLOCK", "FP8_BLOCK"), "MXFP8": ("MXFP8", "MXFP8"),
               "MXFP4": (None, "MXFP4"), "NVFP4": (None, "NVFP4")},
    lora_model="micro-dense", one_per_process=True)

PLUGIN = EnginePlugin(VLLM, "adapters.vllm.engine.VllmRolloutEngine", build,
                      frozenset({COLOCATED, DISAGGREGATED, ATTACHED}), VllmEngineConfig, extra="vllm",
                      cold_start=cold_start, environment=(PYTHON_VAR,), demo=DEMO,
                      server_python=server_python, probe=probe,
                      # every vLLM process runs the plugin; its workers import the extension and the
                      # rl_refit backend, which subclasses vLLM's weight-transfer base and registers
                      # into its factory
                      worker_side=WorkerSide(
                          ("adapters.vllm.plugin", "adapters.vllm.extension", "adapters.vllm.transfer_backend"),
                          ("vllm.distributed.weight_transfer.base", "vllm.distributed.weight_transfer.factory"),
                          "vLLM's weight-transfer modules"),
                      bench=baselines)
