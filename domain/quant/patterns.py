"""Regular expressions from users (`re:` ignore entries, config targets) with bounded matching work.

Python's `re` backtracks: `(.|.)*Z` or `(a+)+$` takes time exponential in the length of a name it
fails to match, and `.*.*.*.*Z` time growing with the fourth power of it. rl-refit matches every
ignore entry against every tensor name, and the engines read the same patterns from the
quantization_config with the same `re`: a pattern of that kind hangs both. So a user's pattern is
read with the standard library's own parser and refused, before anything matches it, when:

- a quantifier that repeats more than once (`*`, `+`, `{m,n}` with n > 1) applies to a group
  that holds another quantifier or an alternation (`(a+)+`, `(.*\\.)*`, `(.|.)*`): exponential;
- more than MAX_REPEATS such quantifiers could backtrack into one another (`.*.*.*.*Z`):
  polynomial, to the power of their count;
- it is longer than MAX_PATTERN_CHARS.

Quantifiers inside atomic groups and lookarounds, and possessive quantifiers, are not counted:
they never backtrack into what they matched (fnmatch's translations use atomic groups). What
remains fails a match in time growing at most with the cube of the name's length.
"""

from __future__ import annotations

import re

# The standard library's own reader of `re` patterns (public as sre_parse before Python 3.11).
import re._constants as sre
import re._parser as _parser
from collections.abc import Iterable
from typing import Any

MAX_PATTERN_CHARS = 1000
MAX_REPEATS = 3

_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT)
_GUARDS = (sre.ATOMIC_GROUP, sre.ASSERT, sre.ASSERT_NOT, sre.POSSESSIVE_REPEAT)
_EXPONENTIAL = ("a quantifier repeats a group that holds another quantifier or an alternation (such as (a+)+ or "
                "(.|.)*), which can take exponential time to fail; repeat single characters or classes, e.g. .* "
                "or [0-9]+")


def _children(op: Any, av: Any) -> list[Any]:
    """The sub-patterns of one parsed item."""
    if op in _REPEATS or op is sre.POSSESSIVE_REPEAT:
        return [av[2]]
    if op is sre.SUBPATTERN:
        return [av[-1]]
    if op is sre.BRANCH:
        return list(av[1])
    if op is sre.ATOMIC_GROUP:
        return [av]
    if op in (sre.ASSERT, sre.ASSERT_NOT):
        return [av[1]]
    if op is sre.GROUPREF_EXISTS:
        return [p for p in av[1:] if p is not None]
    return []


def _ambiguous(sub: Iterable[Any]) -> bool:
    """Whether a sub-pattern can match one text in several ways: it holds a quantifier or an
    alternation at any depth."""
    for op, av in sub:
        if op in _REPEATS or op in (sre.POSSESSIVE_REPEAT, sre.BRANCH, sre.GROUPREF_EXISTS):
            return True
        if any(_ambiguous(child) for child in _children(op, av)):
            return True
    return False


def _exponential(sub: Iterable[Any]) -> bool:
    """Whether a quantifier that repeats more than once repeats an ambiguous group, at any depth."""
    for op, av in sub:
        if op in _REPEATS and av[1] > 1 and _ambiguous(av[2]):
            return True
        if any(_exponential(child) for child in _children(op, av)):
            return True
    return False


def _backtracking_repeats(sub: Iterable[Any], guarded: bool = False) -> int:
    """The quantifiers that repeat more than once outside atomic groups, lookarounds and
    possessive quantifiers (which never backtrack into what they matched)."""
    count = 0
    for op, av in sub:
        count += op in _REPEATS and av[1] > 1 and not guarded
        count += sum(_backtracking_repeats(child, guarded or op in _GUARDS) for child in _children(op, av))
    return count


def regex_problem(pattern: str) -> str | None:
    """Why a user's regular expression is refused, or None when it is accepted.

    Args:
        pattern: the expression (without the `re:` prefix).

    Returns:
        A short description of what is wrong (invalid, or unbounded matching work), or None.
    """
    if len(pattern) > MAX_PATTERN_CHARS:
        return f"the regular expression is {len(pattern)} characters long, more than {MAX_PATTERN_CHARS}"
    try:
        parsed = _parser.parse(pattern)
        re.compile(pattern)  # what only the compiler checks (look-behind widths, repeat bounds)
    except (re.error, RecursionError, OverflowError) as err:  # deep nesting, huge repeat counts
        reason = "nested too deeply" if isinstance(err, RecursionError) else str(err)
        return f"invalid regular expression {pattern!r}: {reason}"
    if _exponential(parsed):
        return f"regular expression {pattern!r}: {_EXPONENTIAL}"
    repeats = _backtracking_repeats(parsed)
    if repeats > MAX_REPEATS:
        return (f"regular expression {pattern!r}: {repeats} quantifiers that backtrack (such as .* or [0-9]+), more "
                f"than {MAX_REPEATS}: the work to fail a match grows with the name's length to that power; use "
                "fewer (e.g. .*\\.layers\\.[0-9]+\\..*), or make some possessive ([0-9]++) or atomic ((?>...))")
    return None
