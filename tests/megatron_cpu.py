"""Run megatron-core on CPU in tests: a context manager and a pytest fixture.

megatron-core needs three things to run a tiny model on a machine without CUDA:
- `torch.cuda.current_device()` answers with the CPU, because Megatron creates tensors on
  `device=torch.cuda.current_device()`;
- the CUDA RNG tracker's `fork()` is a null context (it would switch CUDA RNG states), and
  `Tensor.cuda()` a no-op (a pipeline's last stage moves its embedding copy to CUDA);
- a torch.distributed process group (gloo, world size 1) and
  `parallel_state.initialize_model_parallel(tp, pp)`.

Usage in a test module (import the fixture into the module's namespace so pytest finds it):

    from tests.megatron_cpu import megatron_cpu_env, tiny_gpt_model  # noqa: F401

    def test_something(megatron_cpu_env):
        model = tiny_gpt_model()

The module imports megatron lazily: importing it without megatron-core installed is fine; the
fixture skips the test with a reason instead.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def megatron_cpu(tp: int = 1, pp: int = 1) -> Iterator[None]:
    """Make megatron-core run on CPU inside the block (world size 1, gloo).

    Args:
        tp: tensor-model-parallel size handed to `initialize_model_parallel` (1 on one process).
        pp: pipeline-model-parallel size (1 on one process).

    Raises:
        ModuleNotFoundError: megatron-core is not installed.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    mp.setattr(mrandom.CudaRNGStatesTracker, "fork", lambda self, *a, **k: contextlib.nullcontext())
    if not torch.cuda.is_available():  # the last stage's embedding copy goes to CUDA before its all-reduce
        mp.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    created_group = False
    try:
        if not dist.is_initialized():
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
            )
            created_group = True
        parallel_state.initialize_model_parallel(tp, pp)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if created_group and dist.is_initialized():
            dist.destroy_process_group()
        mp.undo()


@pytest.fixture(scope="module")
def megatron_cpu_env() -> Iterator[None]:
    """Module-scoped fixture around `megatron_cpu()`; skips when megatron-core is missing."""
    pytest.importorskip("megatron.core", reason="needs megatron-core (the `megatron` extra)")
    with megatron_cpu():
        yield


def tiny_gpt_model(
    *,
    vocab_size: int = 64,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    max_sequence_length: int = 64,
    tied: bool = True,
    post_process: bool = True,
    seed: int = 0,
    model_cls: type | None = None,
    **config_overrides: Any,
) -> torch.nn.Module:
    """A small megatron-core GPTModel with the local (non-Transformer-Engine) layer spec, on CPU.

    Call inside `megatron_cpu()` (or with the `megatron_cpu_env` fixture active).

    Args:
        tied: share the embedding and output weights.
        post_process: build the last-stage head (False gives a non-last pipeline stage).
        seed: torch seed used for the parameter initialization.
        model_cls: a GPTModel subclass to build instead of GPTModel.
        config_overrides: extra TransformerConfig fields.

    Returns:
        A GPTModel in eval mode with float32 parameters.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        use_cpu_initialization=True,
        **config_overrides,
    )
    model = (model_cls or GPTModel)(
        config=config,
        # MoE when the config has experts: SequentialMLP (one module per expert) in the local spec.
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=config.num_moe_experts),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        share_embeddings_and_output_weights=tied,
        post_process=post_process,
    )
    return model.eval()


def causal_mask(seq_len: int) -> torch.Tensor:
    """Boolean [1, 1, S, S] mask, True where attention is masked (Megatron's convention).

    Megatron's default causal mask is built on CUDA; on CPU pass this one explicitly.
    """
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]


# A tiny Qwen3.5-MoE-like hybrid: GatedDeltaNet layers, a gated-attention layer, routed and shared
# experts, one MTP layer. Every width a multiple of 128 where a projection's rows or columns are, so
# that FP8 128x128 blocks, MX and NVFP4 groups all apply.
HYBRID = dict(
    num_layers=4, hidden_size=128, num_attention_heads=2, num_query_groups=2, kv_channels=64, ffn_hidden_size=256,
    num_moe_experts=4, moe_ffn_hidden_size=128, moe_router_topk=2, moe_shared_expert_intermediate_size=128,
    moe_shared_expert_gate=True, moe_token_dispatcher_type="allgather",
    experimental_attention_variant="gated_delta_net", linear_attention_freq=4, linear_conv_kernel_dim=4,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
    attention_output_gate=True, mtp_num_layers=1,
)
HYBRID_VOCAB = 256


def tiny_hybrid_model(tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, *, seed: int = 0,
                      **config_overrides: Any) -> torch.nn.Module:
    """This rank's part of a tiny hybrid GPTModel built with megatron-core's own GatedDeltaNet
    spec (`get_gated_delta_net_module_spec`), on the current parallel_state (call inside
    `megatron_cpu()` or a launched world). megatron-core assembles hybrids from Transformer Engine
    specs only; here the layers come from its local specs, with the GDN spec's fused norm + input
    projection (a TE module) replaced by a separate input norm and a ColumnParallelLinear.

    Returns:
        A GPTModel: layers 0-2 GatedDeltaNet, layer 3 attention with an output gate, every MLP MoE
        with a shared expert and its gate, one MTP layer on the last stage.
    """
    import dataclasses

    from megatron.core import parallel_state
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as variants
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec_for_backend,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset

    torch.manual_seed(seed)
    config = TransformerConfig(
        use_cpu_initialization=True, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, normalization="RMSNorm", qk_layernorm=True, layernorm_epsilon=1e-6,
        transformer_impl="local", tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp or 1, pipeline_dtype=torch.float32,
        **{**HYBRID, **config_overrides},
    )
    backend = LocalSpecProvider()
    gdn = variants.get_gated_delta_net_module_spec(config, backend=backend)
    gdn.submodules.in_proj = ColumnParallelLinear
    base = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, qk_layernorm=True, normalization="RMSNorm")
    layers = [
        ModuleSpec(module=TransformerLayer,
                   submodules=dataclasses.replace(base.submodules, self_attention=gdn) if linear else base.submodules)
        for linear in variants.get_linear_attention_pattern(config)
    ]
    offset = get_transformer_layer_offset(config)
    per_stage = config.num_layers // pp
    block = TransformerBlockSubmodules(layer_specs=layers[offset : offset + per_stage],
                                       layer_norm=backend.layer_norm(rms_norm=True, for_qk=False))
    mtp = get_gpt_mtp_block_spec_for_backend(config, layers[-1], backend=backend)
    return GPTModel(
        config=config, transformer_layer_spec=block, vocab_size=HYBRID_VOCAB, max_sequence_length=64,
        position_embedding_type="rope", share_embeddings_and_output_weights=False, mtp_block_spec=mtp,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
    ).eval()
