"""MismatchSentinel: watches the train-rollout k3 KL of a quantized rollout and flags a spike.

It arms by the exporter's own rule: the rollout is quantized when `rollout.quantization.linear`,
`moe` or `config_file` is set, or when the model's config.json carries a native
`quantization_config` (at top level or under `text_config`). A BF16 rollout has no
quantization mismatch to watch, so the sentinel stays off (docs/refit.md#the-mismatch-sentinel).
"""

from __future__ import annotations

import math

import attrs

from domain.errors import ConfigError

DEFAULT_K3_THRESHOLD = 0.05  # ten times the seed's worst quantized steady state (k3 0.008, BF16 linear + NVFP4 MoE)


def _set(value: object) -> bool:
    return value is not None and str(value).strip() != "" and str(value).strip().upper() != "BF16"


def active_quantization(linear: object, moe: object, config_file: object, native_method: str | None) -> str | None:
    """What makes the rollout quantized, in words, or None for a BF16 rollout.

    Args:
        linear: rollout.quantization.linear (None or BF16: not set).
        moe: rollout.quantization.moe.
        config_file: rollout.quantization.config_file.
        native_method: the `quant_method` of the native quantization_config the model's config.json
            carries (top level or under text_config; domain.quant.native_config), or None.

    Returns:
        "linear=MXFP8, moe=MXFP8", "config_file=q.json", "native fp8", or None.
    """
    parts = [f"{name}={value}" for name, value in (("linear", linear), ("moe", moe), ("config_file", config_file))
             if _set(value)]
    if parts:
        return ", ".join(parts)
    return None if native_method is None else f"native {native_method}"


@attrs.frozen
class SentinelAlarm:
    """A k3 KL above the sentinel's threshold.

    Attributes:
        k3_kl: the value seen.
        threshold: the sentinel's threshold.
        active: what makes the rollout quantized.
        step: the step it was seen at, or None.
    """

    k3_kl: float
    threshold: float
    active: str
    step: int | None = None

    @property
    def message(self) -> str:
        at = "" if self.step is None else f" at step {self.step}"
        return (f"train-rollout mismatch spike{at}: rollout_corr/k3_kl {self.k3_kl:.4g} > {self.threshold:g} with a "
                f"quantized rollout ({self.active})")


def _threshold(_: object, __: object, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError("mismatch sentinel threshold", f"must be a positive number, got {value!r}")


@attrs.define
class MismatchSentinel:
    """Flags a k3 KL spike of a quantized rollout.

    Attributes:
        active: what makes the rollout quantized ("linear=MXFP8, moe=MXFP8", "native fp8"), or
            None: the sentinel is off.
        threshold: a k3 KL above this (or not finite) is a spike.
        alarms: the spikes seen so far.
    """

    active: str | None
    threshold: float = attrs.field(default=DEFAULT_K3_THRESHOLD, validator=_threshold)
    alarms: list[SentinelAlarm] = attrs.field(factory=list)

    @classmethod
    def for_rollout(cls, linear: object, moe: object, config_file: object, native_method: str | None,
                    threshold: float = DEFAULT_K3_THRESHOLD) -> MismatchSentinel:
        """The sentinel for a rollout's settings and model (`active_quantization` decides).

        Args:
            linear, moe, config_file: rollout.quantization's keys.
            native_method: the quant_method of the model's native quantization_config, or None.
            threshold: the spike threshold on k3 KL (> 0).
        """
        return cls(active_quantization(linear, moe, config_file, native_method), threshold)

    @property
    def armed(self) -> bool:
        return self.active is not None

    @property
    def status(self) -> str:
        """One line: armed and why, or off."""
        if self.active is None:
            return "mismatch sentinel off (BF16 rollout)"
        return f"mismatch sentinel armed: {self.active}; k3_kl threshold {self.threshold:g}"

    def observe(self, k3_kl: float, step: int | None = None) -> SentinelAlarm | None:
        """Check one k3 KL; a spike is recorded and returned.

        Args:
            k3_kl: rollout_corr/k3_kl of one step.
            step: the step, for the message.

        Returns:
            The alarm, or None (no spike, or the sentinel is off).
        """
        if self.active is None or (math.isfinite(k3_kl) and k3_kl <= self.threshold):
            return None
        alarm = SentinelAlarm(k3_kl, self.threshold, self.active, step)
        self.alarms.append(alarm)
        return alarm
