"""Megatron-Core for `refit demo megatron`: a real, sharded Megatron trainer on CPU.

`MegatronDemoKit` gathers what the demo's processes do with Megatron: initialize parallel_state
over the trainer ranks of the refit world (the engine ranks take part in creating the groups and
hold no model), build this rank's GPTModel of the reference architecture
(`adapters.megatron.reference_gpt`), train it (`adapters.megatron.train_step`), describe its
weights with Megatron's own checkpoint metadata (`adapters.megatron.global_weights`), and, in the
command's own process, export the unsharded model of those global weights: the reference every
sharded refit is judged against.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import attrs
import torch

from adapters.megatron.cpu import megatron_on_cpu
from adapters.megatron.global_weights import Piece, load_global, megatron_pieces
from adapters.megatron.hf_names import hf_named_weights
from adapters.megatron.reference_gpt import build_reference_gpt
from adapters.megatron.train_step import causal_mask, train_step
from adapters.reference.config import ReferenceModelConfig
from domain.refit.topology import ParallelLayout

try:
    from megatron.core import parallel_state
except ImportError as err:  # pragma: no cover - exercised only without megatron-core
    raise ModuleNotFoundError("adapters.megatron.demo_kit needs megatron-core (the `megatron` extra)",
                              name="megatron.core") from err


@attrs.frozen
class MegatronDemoKit:
    """Megatron-Core on CPU for the demo, for one reference architecture.

    Attributes:
        config: the reference model's shapes (the engine serves the same architecture).
        seed: the initialization seed.
    """

    config: ReferenceModelConfig
    seed: int = 0

    @contextlib.contextmanager
    def parallel(self, layout: ParallelLayout, rank: int) -> Iterator[torch.nn.Module | None]:
        """Megatron on CPU over the first `layout.size` ranks of the default group, for the block.

        Every rank of the world enters it (the groups are created collectively); trainer ranks
        get their model, engine ranks None.
        """
        with megatron_on_cpu(), torch.compiler.set_stance("force_eager"):
            parallel_state.initialize_model_parallel(
                layout.tp, layout.pp, expert_model_parallel_size=layout.ep,
                expert_tensor_parallel_size=layout.etp, local_world_size=layout.size,
            )
            try:
                yield build_reference_gpt(self.config, layout, seed=self.seed) if rank < layout.size else None
            finally:
                parallel_state.destroy_model_parallel()

    def train_step(self, model: torch.nn.Module, tokens: torch.Tensor, lr: float) -> float | None:
        """One SGD step on `tokens` (the same batch on every rank); the loss on the last stage."""
        return train_step(model, tokens, lr)

    def pieces(self, model: torch.nn.Module) -> list[Piece]:
        """This rank's weights as Megatron's checkpoint metadata describes them (plain data)."""
        return megatron_pieces(model)

    def unsharded(self, pieces: Sequence[Piece], probe: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """In this process: the tp = pp = ep = 1 model of every rank's pieces.

        Args:
            pieces: every trainer rank's `pieces`.
            probe: int64 [B, T] tokens to score with Megatron's own forward.

        Returns:
            (its Hugging Face export in BF16, Megatron's own next-token log-probs of `probe`,
            float32 [B, T - 1]).
        """
        with _one_process(), megatron_on_cpu(), torch.compiler.set_stance("force_eager"):
            parallel_state.initialize_model_parallel(1, 1)
            try:
                model = build_reference_gpt(self.config, ParallelLayout(), seed=self.seed + 1).eval()
                load_global(model, pieces)
                weights = {n: t.detach().to(torch.bfloat16).clone() for n, t in hf_named_weights(model)}
                batch, seq = probe.shape
                with torch.no_grad():
                    logits = model(probe, torch.arange(seq).expand(batch, seq), causal_mask(seq)).float()
                logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, probe[:, 1:, None]).squeeze(-1)
            finally:
                parallel_state.destroy_model_parallel()
        return weights, logp


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """A gloo process group of this process alone (Megatron needs one), unless one exists."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
