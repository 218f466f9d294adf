"""The embedded model as the demos, the benchmarks and the engines' cold starts need it: its shapes,
a config.json for an engine started with dummy weights, checkpoints and exports of a trainer's
current weights, and trainable copies."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from app.composition.tables import TRAINERS
from domain.errors import ConfigError

if TYPE_CHECKING:
    from adapters.hf_checkpoint.reader import HfCheckpoint
    from adapters.megatron.demo_kit import MegatronDemoKit
    from adapters.qat_reference.embedded import EmbeddedModule
    from adapters.reference.config import ReferenceModelConfig
    from app.config_sections import RefitConfig
    from app.services.planning import PlanReport
    from ports.trainer_model import TrainerModel


@attrs.frozen
class EmbeddedWiring:
    """`Services.embedded`: the embedded reference model of `reference.model` and `reference.seed`
    (or of model.path's config.json, with `actor.strategy: reference`).

    Attributes:
        config: the validated configuration.
        checkpoint: the checkpoint at a path (default model.path; None without one).
        plan_report: the configuration's plan report for a checkpoint and a purpose
            (`Services.plan_report`).
    """

    config: RefitConfig
    checkpoint: Callable[..., HfCheckpoint | None]
    plan_report: Callable[..., PlanReport]

    def reference_config(self) -> ReferenceModelConfig:
        """The embedded reference model's shapes: reference.model's, or with model.path and
        actor.strategy reference, the checkpoint's (a Qwen3 / Qwen3-MoE config.json;
        CheckpointError otherwise)."""
        from adapters.reference.config import preset

        config = self.config
        checkpoint = self.checkpoint() if config.actor.strategy == "reference" else None
        if checkpoint is not None:
            from adapters.reference.hf_config import config_from_checkpoint

            return config_from_checkpoint(checkpoint)
        return preset(config.reference.model)

    def reference_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """The embedded reference model's (Hugging Face name, shape) pairs, in layer order."""
        from adapters.reference.config import hf_weight_shapes

        return hf_weight_shapes(self.reference_config())

    def model_dir(self) -> Path:
        """A directory holding the embedded model's `config.json` (Qwen3 / Qwen3-MoE), for an
        engine that starts with dummy weights and receives the real ones by refit."""
        import tempfile

        from adapters.reference.hf import write_config

        prefix = f"rl-refit-{self.config.reference.model}-"
        return write_config(self.reference_config(), tempfile.mkdtemp(prefix=prefix))

    def write_checkpoint(self, trainer: TrainerModel, directory: str | Path) -> Path:
        """The trainer's current weights as a BF16 Hugging Face checkpoint (the source `export`
        quantizes, e.g. for an engine's cold start): the embedded model's config.json, or with
        actor.strategy hf the source checkpoint's (adapters.hf.module.HfModuleTrainer.save)."""
        strategy = self.config.actor.strategy
        save = getattr(trainer, "save", None)
        if strategy == "hf" and callable(save):  # adapters.hf.module: the source's config.json
            return Path(save(directory))
        if strategy == "hf":
            raise ConfigError("actor.hf.load_model", "a checkpoint directory streamed is not written again; set "
                              "actor.hf.load_model: true for a trainer whose weights change")
        from adapters.reference.hf import write_checkpoint

        return write_checkpoint(self.reference_config(), trainer.named_weights(), directory)

    def export_trainer(self, trainer: TrainerModel, out: str | Path) -> Path:
        """Export the trainer's current weights with the configuration's plan into `out`
        (replaced): what an engine started cold from it serves."""
        import tempfile

        from app.services.checkpoint_export import export_checkpoint

        with tempfile.TemporaryDirectory(prefix="rl-refit-bf16-") as src:
            checkpoint = self.checkpoint(str(self.write_checkpoint(trainer, src)))
            if checkpoint is None:  # write_checkpoint returns the directory it wrote
                raise ConfigError("model.path", f"no checkpoint was written into {src}")
            export_checkpoint(checkpoint, out, self.plan_report(checkpoint, purpose="export"), force=True)
        return Path(out)

    def module(self) -> EmbeddedModule:
        """A new trainable copy (torch.nn.Module) of the embedded reference model of
        `reference.model` and `reference.seed`; its `trainer()` is its TrainerModel view."""
        from adapters.qat_reference.embedded import EmbeddedModule
        from adapters.reference.config import preset

        ref = self.config.reference
        return EmbeddedModule.from_seed(preset(ref.model), ref.seed)

    def megatron_demo_kit(self) -> MegatronDemoKit:
        """What `refit demo megatron` needs from Megatron-Core on CPU, for the
        `reference.model` architecture and `reference.seed` (adapters.megatron.demo_kit)."""
        TRAINERS["megatron"].require("actor.strategy", "megatron")
        from adapters.megatron.demo_kit import MegatronDemoKit
        from adapters.reference.config import preset

        ref = self.config.reference
        return MegatronDemoKit(preset(ref.model), ref.seed)
