"""A check that cannot see says so: the digest of a weight the engine keeps packed outside its
(emptied) tensor is UNREADABLE, and a comparison lists it as not compared, never as equal, not
even to another UNREADABLE digest (docs/verification.md, "What the byte comparison covers")."""

from __future__ import annotations

import pytest
import torch

from domain.refit.storage import UNREADABLE, DigestComparison, tensor_digest, weight_digest


def _packed() -> torch.nn.Parameter:
    """What vLLM's CPU build leaves in `layer.weight` of a BF16 Linear layer once it has packed
    the weight into a oneDNN handle: an empty tensor."""
    return torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)


def test_the_digest_of_an_emptied_parameter_is_unreadable_and_a_real_one_is_not() -> None:
    assert weight_digest(_packed()) == UNREADABLE
    assert weight_digest(torch.empty(0, 16)) == UNREADABLE
    w = torch.randn(4, 8).to(torch.bfloat16)
    assert weight_digest(w) == tensor_digest(w) != UNREADABLE


def test_two_unreadable_digests_are_not_compared_let_alone_equal() -> None:
    before, after = {"proj.weight": weight_digest(_packed())}, {"proj.weight": weight_digest(_packed())}
    check = DigestComparison.of(before, after)
    assert check.unreadable == ("proj.weight",) and check.compared == () and check.differing == ()
    assert check.same is None  # nothing could be compared: neither equal nor different


@pytest.mark.parametrize("other", ["readable", "unreadable"])
def test_an_unreadable_side_is_listed_and_the_readable_rest_still_decides(other: str) -> None:
    norm = torch.ones(8)
    before = {"proj.weight": UNREADABLE, "norm.weight": tensor_digest(norm)}
    after = {"proj.weight": tensor_digest(torch.randn(4, 8)) if other == "readable" else UNREADABLE,
             "norm.weight": tensor_digest(norm.clone())}
    same = DigestComparison.of(before, after)
    assert same.unreadable == ("proj.weight",) and same.compared == ("norm.weight",) and same.same is True
    changed = DigestComparison.of(before, {**after, "norm.weight": tensor_digest(norm * 2)})
    assert changed.differing == ("norm.weight",) and changed.same is False and changed.unreadable == ("proj.weight",)


def test_a_name_on_one_side_only_differs_and_skipped_names_are_left_out() -> None:
    a = {"x": tensor_digest(torch.ones(2)), "gone": UNREADABLE}
    b = {"x": tensor_digest(torch.ones(2)), "new": tensor_digest(torch.zeros(2))}
    check = DigestComparison.of(a, b)
    assert check.differing == ("gone", "new") and check.same is False
    assert DigestComparison.of(a, b, skip=frozenset({"gone", "new"})).same is True
