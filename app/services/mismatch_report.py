"""`refit mismatch`: for each preset, one refit of the trainer's weights into a rollout engine
quantized that way, then the trainer's log-probs against the rollout's on the same tokens, with
verl's metric names (domain.mismatch.verl_metrics) and the mismatch sentinel's verdict.

One trainer serves every preset; each preset gets an engine of its own, started, refitted, scored
and closed before the next starts (never two engines at once).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from app.services.mismatch_probe import response_mask, token_batch
from app.services.transaction import describe_plan
from domain.errors import ConfigError, RefitError
from domain.mismatch import verl_metrics
from domain.quant.plan import QuantizationPlan

if TYPE_CHECKING:
    from app.bootstrap import Services


def parse_preset(text: str) -> tuple[str, QuantizationPlan]:
    """`--preset` text -> (label, plan): `NAME` (dense Linear and experts alike, BF16 for none) or
    `LINEAR/MOE` (e.g. `BF16/MXFP4`). A name that is no preset raises ConfigError naming it."""
    parts = [p.strip() for p in text.split("/")]
    if len(parts) not in (1, 2) or not all(parts):
        raise ConfigError("--preset", f"{text!r} is not NAME or LINEAR/MOE (e.g. MXFP8, BF16/MXFP4)")
    linear, moe = parts if len(parts) == 2 else (parts[0], parts[0])
    try:
        plan = QuantizationPlan.from_presets(linear=None if linear.upper() == "BF16" else linear,
                                             moe=None if moe.upper() == "BF16" else moe)
    except ConfigError as err:  # the preset's own message, under the option that named it
        raise ConfigError("--preset", f"{text!r}: {str(err).removeprefix(f'{err.key}: ')}") from None
    except ValueError as err:
        raise ConfigError("--preset", f"{text!r}: {err}") from None
    label = plan.linear.name if plan.linear == plan.moe else f"{plan.linear.name}/{plan.moe.name}"
    return label, plan


@attrs.frozen
class MismatchSettings:
    """What `refit mismatch` scores.

    Attributes:
        presets: (label, plan) per preset, in order.
        seed: seed of the token batch.
        batch: sequences.
        seq_len: tokens per sequence.
        prompt_len: tokens of each sequence's prompt (the rest is the scored response).
        rollout_is: verl's TIS level (token, sequence) or None.
        rollout_rs: verl's MIS level (token, sequence, geometric) or None.
        threshold: rollout_is_threshold and rollout_rs_threshold.
        kl_threshold: the sentinel's k3 KL spike threshold.
    """

    presets: tuple[tuple[str, QuantizationPlan], ...]
    seed: int = 0
    batch: int = 4
    seq_len: int = 64
    prompt_len: int = 16
    rollout_is: str | None = "token"
    rollout_rs: str | None = "token"
    threshold: float = 2.0
    kl_threshold: float = 0.05


@attrs.frozen
class PresetMismatch:
    """One preset's outcome.

    Attributes:
        label: the preset as given (`MXFP8`, `BF16/MXFP4`).
        plan: the plan in words.
        metrics: verl's metrics (empty when the preset did not run).
        sentinel: the sentinel's status line for this rollout.
        alarm: the sentinel's spike message, or None.
        error: `Type: message` when the engine refused the preset or its refit failed, else None.
    """

    label: str
    plan: str
    metrics: dict[str, float]
    sentinel: str
    alarm: str | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class MismatchResult:
    engine: str
    model: str
    tokens: int
    rows: tuple[PresetMismatch, ...]

    @property
    def ok(self) -> bool:
        return all(r.error is None for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "model": self.model, "tokens": self.tokens,
                "presets": [r.to_dict() for r in self.rows], "ok": self.ok}


def run_mismatch(services: Services, settings: MismatchSettings, *, engine_label: str, model: str) -> MismatchResult:
    """Score every preset of `settings` (see the module's docstring).

    Args:
        services: the composition root's services (rollout.name picks the engine).
        settings: the presets and the batch.
        engine_label: the engine as the user named it, for the report.
        model: the model as the user named it.

    Returns:
        The MismatchResult; a preset the engine refuses (a typed error) is a row with its error.
    """
    trainer = services.trainer_model()
    ids = token_batch(trainer.config.vocab_size, settings.batch, settings.seq_len, settings.seed + 30_000)  # type: ignore[attr-defined]
    mask = response_mask(settings.batch, settings.seq_len, settings.prompt_len)
    rows = [_score(services, trainer, label, plan, ids, mask, settings) for label, plan in settings.presets]
    return MismatchResult(engine_label, model, int(mask.sum()), tuple(rows))


def _score(services: Services, trainer: Any, label: str, plan: QuantizationPlan, ids: Any, mask: Any,
           settings: MismatchSettings) -> PresetMismatch:
    sentinel = services.mismatch_sentinel(settings.kl_threshold, plan=plan)
    row = {"label": label, "plan": describe_plan(plan), "sentinel": sentinel.status}
    engine = None
    try:
        engine = services.rollout_engine(plan)
        report = services.refit_service(plan=plan, trainer=trainer, engine=engine).refit()
        if not report.ok:
            return PresetMismatch(**row, metrics={}, error=f"refit {report.outcome.value}: {report.error}")
        old, _ = trainer.log_probs(ids)
        new, _ = engine.log_probs(ids)
    except RefitError as err:
        return PresetMismatch(**row, metrics={}, error=f"{type(err).__name__}: {err}")
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    metrics = verl_metrics(old, new, mask, rollout_is=settings.rollout_is, rollout_rs=settings.rollout_rs,
                           threshold=settings.threshold)
    alarm = sentinel.observe(metrics["rollout_corr/k3_kl"])
    return PresetMismatch(**row, metrics=metrics, alarm=None if alarm is None else alarm.message)


def presets_of(texts: Sequence[str] | None, default: Sequence[str]) -> tuple[tuple[str, QuantizationPlan], ...]:
    """The presets `--preset` names (each once, in order), or the default ones."""
    chosen = [parse_preset(t) for t in (texts or default)]
    seen: dict[str, QuantizationPlan] = {}
    for label, plan in chosen:
        seen.setdefault(label, plan)
    return tuple(seen.items())
