"""Configuration: the schema of verl-style keys, loading from YAML or a dict, dotted overrides.

Every key is declared once, as the field of its typed section (app.config_sections: type, default,
allowed values, check, its line of docs/configuration.md, whose table is generated from them);
unknown keys and wrong types raise errors that name the key and list the valid ones.

verl's own files load unchanged: keys under `actor_rollout_ref.` are read without that prefix
(`actor_rollout_ref.rollout.name` is `rollout.name`), and in such a file the keys rl-refit does
not read (verl's batch sizes, optimizer, `data.*`, `trainer.*`, ...) are set aside as unused,
except inside `rollout.quantization`, which is rl-refit's own: a typo there is still an error.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from adapters.system.files import read_regular
from app.config_sections import KEYS, SCHEMA, RefitConfig
from app.config_yaml import quote_hint, read_yaml
from domain.errors import ConfigError, ConfigTypeError, RemovedConfigKey, UnknownConfigKey
from domain.quant.formats import FORMATS
from domain.settings import Key, _check_plain, _hf_overrides, _short, validate_value

__all__ = ["KEYS", "SCHEMA", "Key", "RefitConfig", "build_config", "load_config", "parse_override"]


def _children(prefix: str) -> list[str]:
    """Valid next path components under `prefix` ("" for the top level)."""
    head = f"{prefix}." if prefix else ""
    return sorted({k.path[len(head):].split(".")[0] for k in SCHEMA if k.path.startswith(head)})


def _unknown(path: str) -> UnknownConfigKey:
    prefix, _, last = path.rpartition(".")
    while prefix and not _children(prefix):
        prefix, _, last = prefix.rpartition(".")
    valid = _children(prefix)
    close = difflib.get_close_matches(last, valid, n=1)
    hint = f"; did you mean {(prefix + '.' if prefix else '') + close[0]!r}?" if close else ""
    where = f"under {prefix!r}" if prefix else "at the top level"
    return UnknownConfigKey(path, f"unknown key; valid keys {where}: {', '.join(valid)}{hint}")


def _free_parent(path: str) -> Key | None:
    return next((k for k in SCHEMA if k.free and path.startswith(k.path + ".")), None)


VERL_ROOT = "actor_rollout_ref"
# rl-refit's own sections: unknown keys there are errors even in a verl file.
STRICT_SECTIONS = ("rollout.quantization",)
# verl's names for rl-refit keys.
ALIASES: dict[str, str] = {
    "rollout.quantization_config_file": "rollout.quantization.config_file",
    "actor.megatron.qat.quantization_config_path": "rollout.quantization.config_file",
}
# hydra's instantiation hint in verl's files: never a setting.
_HYDRA_KEYS = ("_target_",)


def _section_problem(path: str, value: Any) -> str:
    children = _children(path)
    example = next(k.path for k in SCHEMA if k.path.startswith(path + "."))
    return (f"is a section, not a value (got {type(value).__name__} {_short(value, 60)}); set one of its keys "
            f"({', '.join(children)}), e.g. {example}=..., or give a mapping")


def _removed_quantization_form(path: str, value: Any) -> RemovedConfigKey:
    """`rollout.quantization=fp8` (a string) was replaced by the per-role presets."""
    text = str(value).strip()
    preset = "FP8_BLOCK" if text.lower() == "fp8" else text.upper().replace("-", "_")
    if preset in FORMATS and preset != "BF16":
        fix = (f"write rollout.quantization.linear={preset} and rollout.quantization.moe={preset}"
               + (" (block FP8, 128x128 weight blocks, which quantization=fp8 served)" if preset == "FP8_BLOCK" else ""))
    else:
        fix = "write rollout.quantization.linear and rollout.quantization.moe, each one of FP8_BLOCK, MXFP8, MXFP4, NVFP4"
    return RemovedConfigKey(path, f"the string form rollout.quantization={text} was removed; {fix}, or "
                                  "rollout.quantization.config_file for a compressed-tensors config")


def _strict(path: str) -> bool:
    return any(path == s or path.startswith(s + ".") for s in STRICT_SECTIONS)


@attrs.define
class _Reader:
    """Flattens a configuration tree into {dotted key: value}, noting keys it sets aside."""

    lenient: bool = False  # a verl file: keys rl-refit does not read are set aside
    flat: dict[str, Any] = attrs.field(factory=dict)
    origin: dict[str, str] = attrs.field(factory=dict)
    unused: list[str] = attrs.field(factory=list)

    def set(self, path: str, value: Any, written: str) -> None:
        path = ALIASES.get(path, path)
        old = self.flat.get(path)
        if path in self.flat and old is not None and value is not None and old != value:
            raise ConfigError(path, f"set twice with different values ({self.origin[path]}={old!r} and "
                                    f"{written}={value!r}); keep one of them")
        if path in self.flat and value is None:
            return  # verl's files write null for what they leave unset: it does not clear the other spelling
        self.flat[path], self.origin[path] = value, written

    def tree(self, tree: Mapping[str, Any], prefix: str = "", written: str = "") -> None:
        for name, value in tree.items():
            if not str(name).strip():  # an empty key would name its parent section
                raise _unknown(f"{prefix}.<empty key>".lstrip("."))
            path = f"{prefix}.{name}" if prefix else str(name)
            shown = f"{written}.{name}" if written else str(name)
            if not prefix and "." in str(name):  # verl writes `actor_rollout_ref.actor.megatron.x:` at top level
                head, *rest = str(name).split(".")
                for part in reversed(rest):
                    value = {part: value}
                self.tree({head: value})
            elif not prefix and name == VERL_ROOT and isinstance(value, Mapping):
                reader = _Reader(lenient=True, flat=self.flat, origin=self.origin, unused=self.unused)
                reader.tree(value, "", VERL_ROOT)
            else:
                self.entry(path, value, shown)

    def entry(self, path: str, value: Any, written: str) -> None:
        if path.rpartition(".")[2] in _HYDRA_KEYS:
            return
        target = ALIASES.get(path, path)
        if target in KEYS:
            self.set(path, value, written)
        elif _children(path) and (value is None or isinstance(value, Mapping)):
            self.tree(value or {}, path, written)
        elif path == "rollout.quantization":
            raise _removed_quantization_form(path, value)
        elif _children(path):
            raise ConfigTypeError(path, _section_problem(path, value))
        elif self.lenient and not _strict(path):
            self.unused.append(written)
        else:
            raise _unknown(path)


def _flatten(tree: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The tree's values by dotted key (verl's `actor_rollout_ref.` prefix dropped), and the
    keys of a verl file that rl-refit does not read."""
    reader = _Reader(lenient=any(str(k).split(".")[0] == VERL_ROOT for k in tree))
    reader.tree(tree)
    return reader.flat, reader.unused


def _set_free(flat: dict[str, Any], key: Key, path: str, value: Any) -> None:
    current = _hf_overrides(key.path, _check_plain(key.path, flat.get(key.path))) or {}
    if not isinstance(current, dict):
        raise ConfigTypeError(key.path, f"expected a dict to set {path!r} in, got {type(current).__name__}")
    node = current = json.loads(json.dumps(current))
    parts = path[len(key.path) + 1:].split(".")
    for depth, part in enumerate(parts[:-1], start=1):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            inner = ".".join([key.path, *parts[:depth]])
            raise ConfigTypeError(path, f"{inner} holds {type(node).__name__} {_short(node, 40)}, not a mapping "
                                  f"to set {parts[-1]!r} in; set {inner} to a mapping, or drop one of the overrides")
    node[parts[-1]] = value
    flat[key.path] = current


def parse_override(text: str) -> tuple[str, Any]:
    """Split `a.b.c=VALUE` and read VALUE as YAML (null, true, 3, [a, b], {k: v}).

    Args:
        text: one command-line override.

    Returns:
        (dotted key, value). A VALUE that is not valid YAML raises ConfigError naming the key
        and showing the quoted form.
    """
    key, sep, raw = text.partition("=")
    key = key.strip().lstrip("+")  # hydra's `+key=` / `++key=` (add / force-add) as verl users write
    if not sep or not key:
        raise ConfigError(text, "an override is written KEY=VALUE, e.g. rollout.quantization.linear=FP8_BLOCK")
    if not raw.strip():
        return key, None
    try:
        value = read_yaml(raw)
    except ValueError as err:
        hint = quote_hint(key, raw) if len(raw) <= 200 else f"{key}='...'"
        raise ConfigError(
            key, f"the value {_short(raw)} is not valid YAML ({err}); quote it, e.g. {hint} "
            "(in a shell, wrap the whole override in double quotes)"
        ) from None
    return key, value


def build_config(tree: Mapping[str, Any] | None = None, overrides: Sequence[str] = ()) -> RefitConfig:
    """Validate a configuration dict, apply dotted overrides, fill the defaults.

    Args:
        tree: nested dict of verl-style keys (missing keys take their defaults).
        overrides: `KEY=VALUE` strings, applied in order after `tree`.

    Returns:
        The typed configuration (frozen sections), every key validated once.
    """
    if tree is not None and not isinstance(tree, Mapping):
        raise ConfigTypeError("<root>", f"a configuration is a mapping of sections, got {type(tree).__name__}")
    check_overrides(overrides)
    flat, unused = _flatten(tree or {})
    for text in overrides:
        written, value = parse_override(text)
        verl = written.startswith(VERL_ROOT + ".")
        path = written.removeprefix(VERL_ROOT + ".")
        if ALIASES.get(path, path) in KEYS:
            flat[ALIASES.get(path, path)] = value
        elif (free := _free_parent(path)) is not None:
            _set_free(flat, free, path, value)
        else:
            reader = _Reader(lenient=verl)
            reader.entry(path, value, written)
            flat.update(reader.flat)
            unused.extend(reader.unused)
    values = {k.path: validate_value(k, flat[k.path]) for k in SCHEMA if k.path in flat}  # in SCHEMA's order
    return RefitConfig.from_values(values, tuple(unused))


def check_overrides(overrides: object) -> None:
    """Raise ConfigTypeError unless `overrides` is a list (or tuple) of `KEY=VALUE` strings: a
    lone string would be read one character at a time."""
    if isinstance(overrides, str | bytes) or not isinstance(overrides, Sequence):
        raise ConfigTypeError("overrides", f"expected a list of 'KEY=VALUE' strings, got {type(overrides).__name__} "
                              f"{_short(overrides)}; e.g. overrides=['rollout.quantization.linear=FP8_BLOCK']")
    for item in overrides:
        if not isinstance(item, str):
            raise ConfigTypeError("overrides", f"each override is a 'KEY=VALUE' string, got {type(item).__name__} "
                                  f"{_short(item)}")


def load_config(source: str | Path | Mapping[str, Any] | None = None, overrides: Sequence[str] = ()) -> RefitConfig:
    """Load a configuration from a YAML file, a dict, or nothing (defaults), then apply overrides.

    Args:
        source: a YAML file path, a nested dict, or None.
        overrides: `KEY=VALUE` strings.

    Returns:
        The validated configuration.
    """
    if source is None or isinstance(source, Mapping):
        return build_config(source, overrides)
    if not isinstance(source, str | Path):
        raise ConfigTypeError("config", f"expected a YAML file path, a mapping or None, got {type(source).__name__} "
                              f"{_short(source)}")
    check_overrides(overrides)
    path = Path(source)
    if path.is_dir():
        raise ConfigError("CONFIG", f"configuration file {str(path)!r} is a directory; pass a YAML file")
    if not path.exists():
        raise ConfigError("CONFIG", f"configuration file {str(path)!r} does not exist")
    if not path.is_file():
        raise ConfigError("CONFIG", f"configuration file {str(path)!r} is not a regular file; pass a YAML file")
    try:
        tree = read_yaml(read_regular(path).decode("utf-8"))  # never blocks on a FIFO swapped in meanwhile
    except UnicodeDecodeError as err:
        raise ConfigError("CONFIG", f"{path}: not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    except OSError as err:
        raise ConfigError("CONFIG", f"{path}: cannot be read ({err.strerror or err})") from None
    except ValueError as err:
        raise ConfigError("CONFIG", f"{path}: not valid YAML ({err})") from None
    return build_config(tree or {}, overrides)
