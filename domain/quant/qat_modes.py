"""QAT modes: what `actor.megatron.qat.mode` names, as a weight preset and an activation kind.

verl names its QAT modes by weights and activations together (`mxfp4_mxfp8` = MXFP4 weights with
MXFP8 activations); rl-refit's preset names (FP8_BLOCK, MXFP8, MXFP4, NVFP4) are accepted too and
mean the preset with its default activations. Names are read case-insensitively. A mode either
maps to one (preset, activation) pair, which dispatch rule QatMatchesRollout compares with the rollout plan, or is
rejected with the reason the trainer-side export cannot match it.
"""

from __future__ import annotations

import attrs

from domain.errors import ConfigError
from domain.keys import key
from domain.quant.formats import FP8_BLOCK, MXFP4, MXFP8, NVFP4, ActivationScheme, PrecisionFormat

KEY = key("qat", "mode")


@attrs.frozen
class QatMode:
    """One QAT mode.

    Attributes:
        name: the canonical name (`fp8`, `mxfp4_mxfp8`, ...).
        format: the weight preset QAT fake-quantizes to.
        activation: the activation kind QAT fake-quantizes inputs with.
    """

    name: str
    format: PrecisionFormat
    activation: ActivationScheme

    def describe(self) -> str:
        return f"{self.format.name} weights, {self.activation.value} activations"


# verl's mode names (actor_rollout_ref.actor.megatron.qat.mode), then its QAT recipe's
# weight-only NVFP4 mode.
QAT_MODES: dict[str, QatMode] = {m.name: m for m in (
    QatMode("fp8", FP8_BLOCK, ActivationScheme.FP8_GROUP_128),
    QatMode("mxfp8", MXFP8, ActivationScheme.MXFP8),
    QatMode("mxfp4", MXFP4, ActivationScheme.MXFP4),
    QatMode("mxfp4_mxfp8", MXFP4, ActivationScheme.MXFP8),
    QatMode("nvfp4", NVFP4, ActivationScheme.NVFP4_PER_TOKEN),
    QatMode("w4a16", NVFP4, ActivationScheme.NONE),
)}
# rl-refit's own preset names that are not already verl names.
ALIASES: dict[str, str] = {"fp8_block": "fp8"}
# Modes that exist elsewhere but cannot be matched by a trainer-side export, with the reason.
REJECTED: dict[str, str] = {
    "w4a4": "it calibrates static NVFP4 activation scales (activation_observer), an input_global_scale the "
            "trainer-side export cannot compute; use mode nvfp4 (dynamic per-token NVFP4 activations)",
}


def canonical_qat_mode(value: str, key: str = KEY) -> str:
    """A QAT mode's canonical name (`FP8_BLOCK` -> `fp8`), for the configuration schema.

    Modes that can never match a rollout are known names too: the configuration may carry one
    while QAT is off; dispatch rule QatMatchesRollout rejects it once QAT is enabled.

    Args:
        value: the written mode, any case.
        key: the configuration key, for messages.

    Returns:
        The canonical name. Raises ConfigError naming the valid modes.
    """
    text = str(value).strip().lower().replace("-", "_")
    text = ALIASES.get(text, text)
    if text not in QAT_MODES and text not in REJECTED:
        valid = ", ".join([*QAT_MODES, "FP8_BLOCK"])
        raise ConfigError(key, f"unknown QAT mode {value!r}; valid: {valid} (any case)")
    return text


def parse_qat_mode(value: str | None, key: str = KEY) -> QatMode | None:
    """Read a QAT mode.

    Args:
        value: a verl mode name (`fp8`, `mxfp8`, `mxfp4`, `mxfp4_mxfp8`, `nvfp4`, `w4a16`) or an
            rl-refit preset name (`FP8_BLOCK`, ...), any case; None for no mode.
        key: the configuration key, for messages.

    Returns:
        The QatMode, or None. Raises ConfigError naming the valid modes, or saying why a known
        mode cannot be matched.
    """
    if value is None:
        return None
    text = canonical_qat_mode(value, key)
    if text in REJECTED:
        raise ConfigError(key, f"mode {value!r} cannot be matched by the rollout: {REJECTED[text]}")
    return QAT_MODES[text]
