"""One training step of a Megatron-Core GPTModel on any tensor / pipeline / expert parallel layout,
with plain torch.distributed: what `refit demo megatron` trains with on CPU.

Megatron's own schedules (`megatron.core.pipeline_parallel`) allocate their counters on CUDA;
this is the smallest schedule that runs anywhere: one micro-batch, forward through the stages
(each stage sends its hidden states to the next over Megatron's pipeline group, point to point),
the loss on the last stage, backward through the stages (the gradient of each stage's input back
to the previous one), then the gradients averaged over each parameter's data-parallel group
(expert-data-parallel for routed experts) and one SGD update. Tensor and expert parallelism are
the model's own (its layers' collectives).

The model runs in eval mode while it computes gradients (autograd does not depend on the mode):
Megatron refuses MoE layers in training mode under tensor parallelism without sequence
parallelism, and sequence parallelism needs Transformer Engine's or Apex's norms, which a CPU
machine does not have. Eval mode only turns dropout off; the demo's models have none.
"""

from __future__ import annotations

from typing import Any

import torch


def causal_mask(seq_len: int) -> torch.Tensor:
    """[1, 1, S, S], True where attention is masked (Megatron's convention; its default is built on CUDA)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]


def train_step(model: Any, tokens: torch.Tensor, lr: float) -> float | None:
    """Forward, backward and an SGD step on `tokens` (the same batch on every rank).

    Args:
        model: this rank's GPTModel (unwrapped).
        tokens: int64 [B, S + 1]: inputs tokens[:, :-1], labels tokens[:, 1:].
        lr: the SGD learning rate.

    Returns:
        The mean next-token loss on the last stage; None on the other stages.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    batch, seq = inputs.shape
    positions = torch.arange(seq).expand(batch, seq)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    model.eval()
    for p in model.parameters():
        p.grad = None
    received = None
    if not first:
        received = torch.empty(seq, batch, model.config.hidden_size, dtype=torch.float32)
        dist.recv(received, src=ps.get_pipeline_model_parallel_prev_rank())
        received.requires_grad_(True)
        model.set_input_tensor(received)
    out = model(inputs, positions, causal_mask(seq), labels=labels if last else None)
    loss = None
    if last:
        loss = out.float().mean()
        loss.backward()
    else:
        dist.send(out.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        grad = torch.empty_like(out)
        dist.recv(grad, src=ps.get_pipeline_model_parallel_next_rank())
        out.backward(grad)
    if received is not None:
        assert received.grad is not None  # the first layer reads it
        dist.send(received.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            group = ps.get_expert_data_parallel_group() if ".experts." in name else ps.get_data_parallel_group()
            if dist.get_world_size(group) > 1:
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(dist.get_world_size(group))
            p.add_(p.grad, alpha=-lr)
    return float(loss) if loss is not None else None
