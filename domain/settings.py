"""How a configuration key is declared and checked: `setting(...)`, on the field of a typed
section (app.config_sections, and each engine plugin's own section), declares a key once, with its types, default, allowed values, check
and its line of docs/configuration.md (`keys_table` generates that table); `declare` walks the
sections and gives each key its dotted path.

`validate_value(key, value)` is the one check a value passes, whether it came from a YAML file,
a dotted override or a typed section built in Python (app.config_sections).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from domain.errors import ConfigError, ConfigTypeError

NoneType = type(None)


def _short(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters (messages quote what the user wrote)."""
    try:
        text = repr(value)
    except ValueError:  # an int too long for repr (sys.get_int_max_str_digits)
        text = f"<an integer of about {int(value.bit_length() * 0.30103)} digits>"
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def _urls(key: str, value: Any) -> tuple[str, ...]:
    items = tuple(value)
    for item in items:
        if not isinstance(item, str) or not item.startswith(("http://", "https://")):
            raise ConfigError(key, f"{_short(item)} is not an http(s) URL: give each replica's server as http://HOST:PORT")
    return items


def _url(key: str, value: Any) -> Any:
    if value is not None and not str(value).startswith(("http://", "https://")):
        raise ConfigError(key, f"{_short(value)} is not an http(s) URL: give the server as http://HOST:PORT")
    return value


def _hf_overrides(key: str, value: Any) -> Any:
    if isinstance(value, str) and value.strip():
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ConfigError(key, f"not valid JSON ({err.msg} at char {err.pos}); write a dict or a JSON object") from None
        except (ValueError, RecursionError) as err:  # integers too long, nesting too deep
            reason = "nested too deeply" if isinstance(err, RecursionError) else str(err).split(";")[0]
            raise ConfigError(key, f"not valid JSON ({reason}); write a dict or a JSON object") from None
        if not isinstance(value, dict):
            raise ConfigError(key, f"the JSON string must hold an object, got {type(value).__name__}")
    return value or None


MAX_DEPTH = 32  # nesting of a configuration value: far beyond any real one, well within recursion


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, Mapping | list | tuple):
            deepest = max(deepest, depth)
            children = node.values() if isinstance(node, Mapping) else node
            stack.extend((child, depth + 1) for child in children if depth <= MAX_DEPTH)
    return deepest


def _check_plain(key: str, value: Any) -> Any:
    """A value must be plain data: JSON-like types, nested at most MAX_DEPTH levels."""
    if _depth(value) > MAX_DEPTH:
        raise ConfigError(key, f"the value is nested more than {MAX_DEPTH} levels deep; flatten it")
    try:
        json.dumps(value)
    except (TypeError, ValueError) as err:
        raise ConfigTypeError(key, f"the value holds something that is not plain data ({err}); "
                              "use strings, numbers, booleans, null, lists and mappings") from None
    return value


def _commit_mode(key: str, value: Any) -> Any:
    if value is None:
        return None
    name = str(value).strip().lower().replace("_", "-")
    if name not in ("transactional", "per-layer"):
        raise ConfigError(key, f"invalid value {value!r}; valid: transactional, per-layer (or null)")
    return name


def _positive(key: str, value: Any) -> Any:
    if not value > 0:  # NaN is not positive either
        raise ConfigError(key, f"must be positive, got {_short(value)}")
    return value


MAX_BUCKET_MIB = 1 << 20  # 1 TiB: a bucket is a buffer every rank allocates


def _bucket_mib(key: str, value: Any) -> Any:
    _positive(key, value)
    if value * 2**20 < 1:
        raise ConfigError(key, f"must hold at least one byte ({2**-20:.3g} MiB), got {_short(value)}")
    if value > MAX_BUCKET_MIB:
        raise ConfigError(key, f"must be at most {MAX_BUCKET_MIB} MiB (1 TiB), got {_short(value)}")
    return value


def _positive_seconds(key: str, value: Any) -> Any:
    if not (value > 0 and math.isfinite(value)):  # NaN fails both; .inf would wait forever
        raise ConfigError(key, f"must be a finite positive number of seconds, got {_short(value)}")
    return value


def _at_least(minimum: int) -> Callable[[str, Any], Any]:
    def check(key: str, value: Any) -> Any:
        if value < minimum:
            raise ConfigError(key, f"must be {minimum} or more, got {_short(value)}")
        return value

    return check


def _optional_non_negative(key: str, value: Any) -> Any:
    return value if value is None else _non_negative(key, value)


def _positive_or_none(key: str, value: Any) -> Any:
    return value if value is None else _positive(key, value)


def _emulation_mode(key: str, value: Any) -> str:
    """auto, on or off; YAML reads a bare on/off as true/false."""
    mode = {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else str(value).strip().lower()
    if mode not in ("auto", "on", "off"):
        raise ConfigError(key, f"invalid value {_short(value)}; valid: auto, on, off")
    return mode


def _torch_device(key: str, value: Any) -> str:
    """cpu, cuda or cuda:N (whether that GPU is there is checked when the engine is built)."""
    text = str(value).strip().lower()
    head, _, index = text.partition(":")
    if head not in ("cpu", "cuda") or (index and (head == "cpu" or not index.isdigit())):
        raise ConfigError(key, f"invalid device {_short(value)}; valid: cpu, cuda, cuda:N")
    return text


def _non_negative(key: str, value: Any) -> Any:
    if value < 0:
        raise ConfigError(key, f"must be 0 or more, got {_short(value)}")
    return value


@attrs.frozen
class Key:
    """One configuration key: dotted path, accepted types, default, allowed values, its line of
    docs/configuration.md."""

    path: str
    types: tuple[type, ...]
    default: Any
    doc: str
    choices: tuple[Any, ...] | None = None
    check: Callable[[str, Any], Any] | None = None
    free: bool = False  # a free-form dict: keys below it are not checked


@attrs.define
class _Declared:
    """A key as a section's field declares it; its path is known once the tree is walked (declare)."""

    types: tuple[type, ...]
    default: Any
    doc: str
    choices: tuple[Any, ...] | None
    check: Callable[[str, Any], Any] | None
    free: bool
    key: Key | None = None


@attrs.frozen
class _Check:
    """A field's converter: the value checked against its key (validate_value), named by its path."""

    declared: _Declared

    def __call__(self, value: Any) -> Any:
        if self.declared.key is None:
            raise RuntimeError("a configuration section was built before its keys were declared (declare)")
        return validate_value(self.declared.key, value)


def setting(types: tuple[type, ...], default: Any, doc: str, *, choices: tuple[Any, ...] | None = None,
            check: Callable[[str, Any], Any] | None = None, free: bool = False) -> Any:
    """A configuration key, declared once as a section's field: its accepted types, default, its
    line of docs/configuration.md, allowed values and check. The field's converter validates every
    value set in Python as one read from YAML; the dotted path is the field's place in the tree
    (`declare`)."""
    declared = _Declared(types, default, doc, choices, check, free)
    field_default = attrs.Factory(dict) if isinstance(default, dict) else default
    return attrs.field(default=field_default, converter=_Check(declared), metadata={"setting": declared})


def section_of(field: attrs.Attribute[Any]) -> type | None:
    """The section class a field holds (its default is the class's factory), or None for a key."""
    factory = getattr(field.default, "factory", None)
    return factory if isinstance(factory, type) and attrs.has(factory) else None


def declare(root: type, prefix: str = "") -> tuple[Key, ...]:
    """Every key the sections under `root` declare (`setting`), in the tree's order, each with its
    dotted path, which its field's converter names from then on."""
    keys: list[Key] = []
    for field in attrs.fields(root):
        declared = field.metadata.get("setting")
        if declared is not None:
            declared.key = Key(f"{prefix}{field.name}", declared.types, declared.default, declared.doc,
                               declared.choices, declared.check, declared.free)
            keys.append(declared.key)
        elif (section := section_of(field)) is not None:
            keys.extend(declare(section, f"{prefix}{field.name}."))
    return tuple(keys)


_TYPE_NAMES = {str: "string", bool: "bool", int: "int", float: "float", dict: "dict", list: "list", tuple: "list",
               NoneType: "null"}


def type_text(types: tuple[type, ...], choices: tuple[Any, ...] | None = None) -> str:
    """How docs/configuration.md writes what a key takes: its values where it lists them
    (`` `keep`, `abort` or `wait` ``), else its types (`string or null`, int and float a number)."""
    if choices is not None:
        names = [f"`{default_text(c)}`" for c in choices if c is not None] + (["null"] if None in choices else [])
    else:
        names = list(dict.fromkeys(_TYPE_NAMES[t] for t in types))
        if "int" in names and "float" in names:
            names[names.index("int")] = "number"
            names.remove("float")
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def default_text(value: Any) -> str:
    """How docs/configuration.md writes a default: as YAML does."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return "[]" if not value else json.dumps(list(value))
    return json.dumps(value) if isinstance(value, dict) else str(value)


def keys_table(schema: tuple[Key, ...]) -> str:
    """docs/configuration.md's table of keys, generated from their declarations."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    rows += [f"| `{k.path}` | {type_text(k.types, k.choices)} | `{default_text(k.default)}` | {k.doc} |" for k in schema]
    return "\n".join(rows)


def validate_value(key: Key, value: Any) -> Any:
    """`value` checked against `key` (types, choices, its check) and normalized; errors name the key."""
    _check_plain(key.path, value)
    ok = isinstance(value, key.types) and not (isinstance(value, bool) and bool not in key.types)
    if not ok:
        names = " or ".join("null" if t is NoneType else t.__name__ for t in key.types)
        raise ConfigTypeError(key.path, f"expected {names}, got {type(value).__name__} {_short(value)}")
    if key.choices is not None and value not in key.choices:
        valid = ", ".join("null" if c is None else str(c) for c in key.choices)
        raise ConfigError(key.path, f"invalid value {_short(value)}; valid: {valid}")
    value = key.check(key.path, value) if key.check else value
    if isinstance(value, float) and not math.isfinite(value):  # a NaN bound passes every `<` check, and fails all
        raise ConfigError(key.path, f"must be a finite number, got {value}")
    return value
