"""The trainer's side beyond the refit: the fused log-prob forward, packed GatedDeltaNet input
and quantization-aware training, for a model the caller built."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import attrs

from app.composition.tables import TRAINERS
from app.composition.tables import qat_backend as build_qat_backend

if TYPE_CHECKING:
    import torch

    from adapters.megatron.packed_gdn import PackedGdnReport
    from app.config_sections import RefitConfig
    from app.services.logprob import LogProbService
    from app.services.qat_setup import QatSession
    from domain.forward.mode import FusedForwardRequest
    from ports.qat_backend import QatBackend


@attrs.frozen
class TrainerWiring:
    """`Services.trainer_side`: services over the trainer's own model (`bootstrap(model=...)`).

    Attributes:
        config: the validated configuration.
        environ: the honoured environment variables, as the composition root read them.
        model: the model given to bootstrap (None: none).
    """

    config: RefitConfig
    environ: Mapping[str, str]
    model: Callable[[], object | None]

    def fused_forward_request(self) -> FusedForwardRequest:
        """The fused-forward mode asked for: `actor.fused_forward` wins; else `VERL_FUSED_USE_OP_HOOK`
        as read by bootstrap; else auto (FusedForwardModeError names the key or the variable)."""
        from domain.forward.mode import FusedForwardRequest

        return FusedForwardRequest.from_settings(self.config.actor.fused_forward,
                                                 self.environ.get("VERL_FUSED_USE_OP_HOOK"))

    def logprob_service(self, model: object | None = None, *, chunk_size: int | None = None) -> LogProbService:
        """A LogProbService over a Megatron GPTModel (wrappers allowed) or any TrainerModel.

        The fused-forward mode is decided once (`fused_forward_request`). A Megatron model with
        GatedDeltaNet layers also gets packed (THD) GDN input made safe (`packed_gdn`).

        Args:
            model: a Megatron model, or an object that already is a TrainerModel (default: the
                model given to bootstrap).
            chunk_size: tokens per chunk of the fused computation (None: sized from the vocabulary).

        Returns:
            The LogProbService. Raises FusedForwardModeError (a value that is not a mode, naming
            the key or the variable) and FusedHookUnavailable (hook required, forward lacks it).
        """
        from app.services.logprob import LogProbService, is_trainer_model

        model = model if model is not None else self.model()
        request = self.fused_forward_request()
        if is_trainer_model(model):
            return LogProbService(model, mode="none", source=request.source)
        TRAINERS["megatron"].require("actor.strategy", "megatron")
        from adapters.megatron.factory import megatron_trainer

        trainer = megatron_trainer(model, request.mode, gdn_kernels=self.config.actor.megatron.gdn_kernels,
                                   chunk_size=chunk_size)
        return LogProbService(trainer, mode=trainer.mode.value, source=request.source)

    def packed_gdn(self, model: object) -> PackedGdnReport:
        """Let a built Megatron model's GatedDeltaNet layers take packed (THD) input safely.

        A no-op without GDN layers; validation hooks only on Megatron-Core >= 0.18; the
        packed-aware forward before that, with the kernels of `actor.megatron.gdn_kernels`.
        """
        from adapters.megatron.factory import packed_gdn

        return packed_gdn(model, self.config.actor.megatron.gdn_kernels)

    def qat(self, model: torch.nn.Module, *, backend: str = "reference", numerics: str = "exporter",
            layout: str = "auto", model_config: Mapping[str, object] | None = None,
            qat_backend: QatBackend | None = None) -> QatSession | None:
        """QAT for a built trainer model, per actor.megatron.qat.* and the rollout quantization
        (app.services.qat_setup.prepare_qat: the plan on the model's tensors, the settings checked
        against it, the backend applied, every layer's effective precision checked).

        Args:
            model: the trainer model (torch / transformers module, Megatron-Core model on one
                rank, or the embedded model as adapters.qat_reference.embedded.EmbeddedModule).
            backend: "reference" (pure torch) or "modelopt" (nvidia-modelopt).
            numerics: ModelOpt only: "exporter" (default) or "modelopt" (its own kernels, checked).
            layout: the name mapping: "auto", "torch", "megatron" or "reference".
            model_config: the checkpoint's config.json, when there is one.
            qat_backend: a QatBackend to use instead of building one (tests, custom backends).

        Returns:
            The QatSession (call its refresh() after every optimizer step), or None when
            actor.megatron.qat.enable is false.
        """
        from adapters.qat_reference.layouts import weight_shapes
        from app.services.qat_setup import prepare_qat

        config = self.config
        if not config.actor.megatron.qat.enable:
            return None
        chosen = qat_backend or build_qat_backend(backend, numerics, layout)
        return prepare_qat(config, model, chosen, weight_shapes(model, layout), model_config=model_config)
