"""Which path the fused log-prob forward takes through Megatron
(docs/fused-forward.md#modes-how-the-fused-computation-gets-into-megatron).

`auto` uses Megatron-Core's native `output_processor` hook when the model's forward has it and
the legacy patched forward otherwise; `hook` and `legacy` force one. The decision is made once,
when the model is built, from a plain value; nothing here reads the environment.
"""

from __future__ import annotations

import enum

import attrs

from domain.errors import FusedForwardModeError, FusedHookUnavailable
from domain.keys import key

CONFIG_KEY = key("actor", "fused_forward")
ENV_VAR = "VERL_FUSED_USE_OP_HOOK"


class FusedForwardMode(enum.Enum):
    AUTO = "auto"
    HOOK = "hook"
    LEGACY = "legacy"


# Accepted spellings (case-insensitive, surrounding spaces ignored).
MODE_ALIASES: dict[str, FusedForwardMode] = {
    "": FusedForwardMode.AUTO,
    "auto": FusedForwardMode.AUTO,
    "1": FusedForwardMode.HOOK,
    "true": FusedForwardMode.HOOK,
    "yes": FusedForwardMode.HOOK,
    "hook": FusedForwardMode.HOOK,
    "0": FusedForwardMode.LEGACY,
    "false": FusedForwardMode.LEGACY,
    "no": FusedForwardMode.LEGACY,
    "legacy": FusedForwardMode.LEGACY,
}


def parse_fused_forward_mode(
    value: str | bool | int | FusedForwardMode | None, *, key: str = CONFIG_KEY
) -> FusedForwardMode:
    """Turn a configuration or environment value into a mode.

    Args:
        value: None or "" (auto), an alias string, a YAML boolean, 0/1, or a mode.
        key: where the value came from (named in the error).

    Returns:
        The requested mode (AUTO, HOOK or LEGACY).

    Raises:
        FusedForwardModeError: the value is not one of the accepted spellings.
    """
    if value is None:
        return FusedForwardMode.AUTO
    if isinstance(value, FusedForwardMode):
        return value
    if isinstance(value, bool):  # YAML `true` / `false`
        return FusedForwardMode.HOOK if value else FusedForwardMode.LEGACY
    text = str(value).strip().lower() if isinstance(value, (str, int)) else None
    if text is None or text not in MODE_ALIASES:
        accepted = ", ".join(repr(a) for a in MODE_ALIASES)
        raise FusedForwardModeError(
            key,
            f"{value!r} is not a fused-forward mode; accepted (case-insensitive): {accepted} "
            "(auto = '' or auto; hook = 1/true/yes/hook; legacy = 0/false/no/legacy)",
        )
    return MODE_ALIASES[text]


@attrs.frozen
class FusedForwardRequest:
    """The requested mode and where it came from (for messages and logs)."""

    mode: FusedForwardMode = attrs.field(validator=attrs.validators.instance_of(FusedForwardMode))
    source: str = CONFIG_KEY

    @classmethod
    def from_settings(cls, config_value: object, env_value: str | None) -> FusedForwardRequest:
        """The configuration key wins when it is set (not None); else the environment value.

        Args:
            config_value: value of `actor.fused_forward`, or None when unset.
            env_value: value of `VERL_FUSED_USE_OP_HOOK`, or None when unset.

        Returns:
            The parsed request; AUTO from the default source when neither is set.
        """
        if config_value is not None:
            return cls(parse_fused_forward_mode(config_value, key=CONFIG_KEY), CONFIG_KEY)  # type: ignore[arg-type]
        if env_value is not None:
            return cls(parse_fused_forward_mode(env_value, key=ENV_VAR), ENV_VAR)
        return cls(FusedForwardMode.AUTO, "default")


def select_fused_forward_mode(
    requested: FusedForwardMode, *, hook_available: bool, megatron_version: str
) -> FusedForwardMode:
    """The concrete mode (HOOK or LEGACY) for a model whose hook support has been probed.

    Args:
        requested: AUTO, HOOK or LEGACY.
        hook_available: the model's bound forward accepts `output_processor` and
            `output_processor_context`.
        megatron_version: the installed Megatron-Core version (named in the error).

    Returns:
        HOOK or LEGACY.

    Raises:
        FusedHookUnavailable: HOOK was required and the forward has no hook.
    """
    if requested is FusedForwardMode.LEGACY:
        return FusedForwardMode.LEGACY
    if hook_available:
        return FusedForwardMode.HOOK
    if requested is FusedForwardMode.HOOK:
        raise FusedHookUnavailable(
            f"fused forward mode 'hook' needs Megatron-Core's output_processor hook, but the "
            f"model's forward has no `output_processor`/`output_processor_context` parameters "
            f"(installed Megatron-Core {megatron_version}; the hook arrived in 0.18). Set "
            f"{CONFIG_KEY} (or {ENV_VAR}) to 'auto' or 'legacy', or upgrade Megatron-Core."
        )
    return FusedForwardMode.LEGACY
