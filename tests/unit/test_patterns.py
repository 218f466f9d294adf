"""User regular expressions are matched with bounded work: the exponential and high-power shapes of
Python's backtracking `re` are refused before anything matches them; what is accepted fails a
match quickly even on the names that make backtracking worst."""

from __future__ import annotations

import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from domain.quant import naming
from domain.quant.patterns import MAX_PATTERN_CHARS, regex_problem


@pytest.mark.parametrize("pattern", ["(.|.)*Z", "(a+)+$", "(.*\\.)*lm_head", "(ab|a)*c", "(a?){2,}b", "(?>(a+)+)b"])
def test_exponential_shapes_are_refused(pattern: str) -> None:
    problem = regex_problem(pattern)
    assert problem is not None and "exponential" in problem


@pytest.mark.parametrize("pattern", [".*.*.*.*Z", "\\w*\\w*\\w*\\w*!", ".*\\.layers\\.\\d+\\.mlp\\.\\d+\\..*"])
def test_more_than_three_backtracking_quantifiers_are_refused(pattern: str) -> None:
    problem = regex_problem(pattern)
    assert problem is not None and "more than 3" in problem and "possessive" in problem


@pytest.mark.parametrize("pattern", [
    ".*", ".*layers\\.(0|47)\\..*", "(.*\\.)?lm_head$", ".*\\.layers\\.[0-9]+\\..*", "(a|b)*c",
    ".*\\.layers\\.\\d++\\.mlp\\.\\d++\\..*",  # possessive quantifiers never backtrack
    "(?s:(?>.*?layers\\.)(?>.*?\\.mlp).*)\\Z",  # fnmatch's translation: atomic groups
    *(entry[3:] for entry in (*naming.DEFAULT_IGNORE, naming.EXPERTS_PATTERN) if entry.startswith("re:")),
])
def test_patterns_people_write_are_accepted(pattern: str) -> None:
    assert regex_problem(pattern) is None


def test_invalid_and_overlong_patterns_say_why() -> None:
    assert "invalid regular expression '('" in (regex_problem("(") or "")
    assert "look-behind" in (regex_problem("(?<=a+)b") or "")  # only the compiler checks this
    assert "more than" in (regex_problem("a" * (MAX_PATTERN_CHARS + 1)) or "")
    assert naming.validate_ignore_entry("re:(.|.)*Z") is not None
    assert naming.validate_ignore_entry("*mlp.gate") is None  # a shell pattern is no regex


ATOMS = st.sampled_from([".", "a", "\\.", "[a.]", "[0-9]", "\\w"])
QUANTIFIERS = st.sampled_from(["", "*", "+", "?", "{0,3}", "*?"])


def _regexes() -> st.SearchStrategy[str]:
    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        return st.one_of(
            st.tuples(inner, inner).map("".join),
            st.tuples(inner, QUANTIFIERS).map(lambda t: f"({t[0]}){t[1]}"),
            st.tuples(inner, inner, QUANTIFIERS).map(lambda t: f"({t[0]}|{t[1]}){t[2]}"),
        )

    return st.recursive(st.tuples(ATOMS, QUANTIFIERS).map("".join), extend, max_leaves=8)


# Names that make a backtracking match fail slowly: one long run of what the atoms match.
WORST_NAMES = ("a" * 128, "a." * 64, "." * 128, "0" * 128)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(pattern=_regexes())
def test_what_is_accepted_fails_a_match_quickly(pattern: str) -> None:
    if regex_problem(pattern + "Z") is not None:
        return
    compiled = re.compile(pattern + "Z")  # a Z the names lack: every match fails, after all the work
    start = time.perf_counter()
    for name in WORST_NAMES:
        assert compiled.match(name) is None
    # a generous ceiling that no load reaches: a pattern that backtracks catastrophically takes
    # 2**64 steps and more on these names, not seconds
    assert time.perf_counter() - start < 30.0, pattern
