"""YAML text as configuration reads it: strictly (no aliases, no Python tags, bounded nesting),
with errors that say where, and the quoted form that fixes an override that does not parse."""

from __future__ import annotations

import re
from typing import Any, ClassVar

import yaml

_FLOAT_TAG = "tag:yaml.org,2002:float"
# YAML 1.2 floats (and OmegaConf's, which reads verl's files): `1e-30` and `1E5` are numbers, where
# PyYAML's YAML 1.1 resolver wants a dot in the mantissa and reads them as strings.
_FLOAT = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                      |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                      |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                      |[-+]?\.(?:inf|Inf|INF)
                      |\.(?:nan|NaN|NAN))$""", re.X)


class _StrictLoader(yaml.SafeLoader):
    """safe_load without aliases: `*anchor` references can expand a few bytes into gigabytes
    once a value is copied (a "billion laughs" document), and configurations never need them.
    Floats resolve as YAML 1.2 writes them (`_FLOAT`)."""

    yaml_implicit_resolvers: ClassVar[dict[Any, Any]] = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != _FLOAT_TAG]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not accepted", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        # PyYAML keeps the last of two equal keys; an override given twice is refused, so is this
        first: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                seen = first.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: SafeLoader's own error says so
                break
            if seen is not key_node.start_mark:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (line {seen.line + 1} and line "
                    f"{key_node.start_mark.line + 1}); keep one", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


_StrictLoader.add_implicit_resolver(_FLOAT_TAG, _FLOAT, list("-+0123456789."))


def read_yaml(text: str) -> Any:
    """Parse YAML text strictly: no aliases, no Python tags (safe_load), bounded nesting.

    Args:
        text: the document.

    Returns:
        The value. Raises ValueError with the reason: YAML errors, integers too long to convert,
        nesting too deep for the parser.
    """
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"{err.problem or err.context}{where}") from None
    except yaml.YAMLError as err:
        raise ValueError(" ".join(str(err).split())) from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except ValueError as err:  # e.g. an integer of more than sys.get_int_max_str_digits() digits
        raise ValueError(str(err).split(";")[0]) from None


def quote_hint(key: str, raw: str) -> str:
    """A corrected override for a value that is not valid YAML: quote it so that it reads as a
    string (or, for a list of regexes, single-quote the items: YAML single quotes keep
    backslashes)."""
    candidates = []
    if '"' in raw and "'" not in raw:
        candidates.append(raw.replace('"', "'"))
    candidates.append("'" + raw.replace("'", "''") + "'")
    for fixed in candidates:
        try:
            read_yaml(fixed)
        except ValueError:
            continue
        return f"{key}={fixed}"
    return f"{key}='...'"  # pragma: no cover - a single-quoted scalar always parses
