"""Configuration keys as messages write them: the one place the domain spells a key.

The domain names the setting a message is about (`key("quantization", "linear")`); the section
roots of the verl-style configuration live here only, so that a change to the configuration's
shape changes one table.
"""

from __future__ import annotations

# Section -> the key prefix it stands for.
SECTIONS: dict[str, str] = {
    "rollout": "rollout",
    "quantization": "rollout.quantization",
    "checkpoint_engine": "rollout.checkpoint_engine",
    "engine_kwargs": "rollout.engine_kwargs",
    "actor": "actor",
    "megatron": "actor.megatron",
    "qat": "actor.megatron.qat",
    "te": "actor.megatron.override_transformer_config",
    "model": "model",
}


def key(section: str, *names: str) -> str:
    """The configuration key of a setting.

    Args:
        section: a SECTIONS name ("quantization", "qat", "rollout", ...).
        names: the setting's names inside the section, outermost first.

    Returns:
        The dotted key: `key("quantization", "linear") == "rollout.quantization.linear"`,
        `key("engine_kwargs", "<engine>", "hf_overrides")`. Raises KeyError for an unknown section
        (a bug in the caller, not in a configuration).
    """
    return ".".join((SECTIONS[section], *names))
