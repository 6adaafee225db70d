"""Budget semantics: what is accepted, what it means in bytes, and the errors for the rest."""

from __future__ import annotations

import pytest
import torch

import remat_pass
from remat_pass import InvalidBudgetError
from remat_pass.budget import Budget, parse_budget


@pytest.mark.parametrize(
    "value, expected",
    [
        (0.4, Budget(fraction=0.4)),
        (1.0, Budget(fraction=1.0)),
        (300_000_000, Budget(nbytes=300_000_000)),
        ("512MB", Budget(nbytes=512 * 10**6)),
        ("2GiB", Budget(nbytes=2 * 2**30)),
        ("1.5 KiB", Budget(nbytes=1536)),
        ("4096", Budget(nbytes=4096)),
        ("100b", Budget(nbytes=100)),
    ],
)
def test_accepted_budgets(value, expected):
    assert parse_budget(value) == expected


@pytest.mark.parametrize("value", ["abc", 0, -1, 1.5, 0.0, -0.5, float("nan"), "10XB", "", None, True, [0.5], "-5MB"])
def test_bad_budgets_say_what_is_accepted(value):
    with pytest.raises(InvalidBudgetError) as raised:
        parse_budget(value)
    assert isinstance(raised.value, ValueError)
    assert "(0, 1]" in str(raised.value) or "positive" in str(raised.value)


@pytest.mark.parametrize("value", ["abc", 0, -1, 1.5, "10XB", None])
def test_optimize_rejects_bad_budgets_before_tracing(value):
    with pytest.raises(ValueError, match="budget"):
        remat_pass.optimize(torch.nn.Linear(2, 2), budget=value)


def test_fraction_resolves_against_keep_all_bytes():
    assert Budget(fraction=0.5).resolve(1001) == 500
    assert Budget(fraction=1.0).resolve(1001) == 1001
    assert Budget(nbytes=7).resolve(1001) == 7
