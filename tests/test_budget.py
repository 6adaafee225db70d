"""Budget semantics: what is accepted, what it means in bytes, and the errors for the rest."""

from __future__ import annotations

import pytest
import torch

import remat_pass
from remat_pass import InvalidBudgetError
from remat_pass.planning.budget import Budget, parse_budget


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


# --- spelling traps: numbers in strings, ints that mean fractions ------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0.3", Budget(fraction=0.3)),  # a fraction read from a config file
        (" 1.0 ", Budget(fraction=1.0)),
        ("1e-1", Budget(fraction=0.1)),
        (".5", Budget(fraction=0.5)),
        ("4096", Budget(nbytes=4096)),
        ("1e9", None),  # a float, as the literal would be: not a fraction, refused
        ("-0.3", None),
    ],
)
def test_numeric_string_parses_as_the_number_would(text, expected):
    number = float(text) if any(c in text for c in ".e") else int(text)
    if expected is None:
        with pytest.raises(InvalidBudgetError):
            parse_budget(number)
        with pytest.raises(InvalidBudgetError):
            parse_budget(text)
        return
    assert parse_budget(text) == parse_budget(number) == expected


@pytest.mark.parametrize("value", [1, "1"])
def test_budget_one_is_refused_with_did_you_mean_one_point_zero(value):
    with pytest.raises(InvalidBudgetError, match=r"did you mean 1\.0\?") as raised:
        parse_budget(value)
    assert "budget='1B'" in str(raised.value)


@pytest.mark.parametrize("value, guess", [(2, "0.02"), (30, "0.3"), ("50", "0.5"), (100, "1")])
def test_percentage_like_int_budgets_are_refused_with_a_guess(value, guess):
    with pytest.raises(InvalidBudgetError, match=f"did you mean {guess}\\?") as raised:
        parse_budget(value)
    assert f"'{value}B'" in str(raised.value) and "percentage" in str(raised.value)


def test_tiny_caps_are_accepted_with_a_unit_and_bare_ints_above_one_hundred():
    from remat_pass.planning.budget import MAX_AMBIGUOUS_INT

    assert MAX_AMBIGUOUS_INT == 100
    assert parse_budget("64B") == Budget(nbytes=64) and parse_budget("1b") == Budget(nbytes=1)
    assert parse_budget(101) == Budget(nbytes=101) and parse_budget("101") == Budget(nbytes=101)


def test_optimize_refuses_budget_one_before_tracing():
    with pytest.raises(InvalidBudgetError, match=r"did you mean 1\.0\?"):
        remat_pass.optimize(torch.nn.Linear(2, 2), budget=1)


def test_a_peak_budget_says_when_the_loss_is_outside_the_plan(caplog):
    """A peak budget bounds the planned graph; logits returned to a loss outside are not bounded."""
    import logging

    import remat_pass

    from .models import GPTWithLoss, tiny_gpt_config

    torch.manual_seed(0)
    with_loss = GPTWithLoss(tiny_gpt_config())
    tokens = torch.randint(0, 64, (2, 16))
    targets = torch.randint(0, 64, (2, 16))
    with caplog.at_level(logging.WARNING, logger="remat_pass.planning.pipeline"):
        remat_pass.optimize(with_loss.gpt, budget=0.9, budget_kind="peak", example_inputs=(tokens,))
    assert "not a scalar loss" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="remat_pass.planning.pipeline"):
        remat_pass.optimize(with_loss, budget=0.9, budget_kind="peak", example_inputs=(tokens, targets))
    assert "not a scalar loss" not in caplog.text



class _LossAndLogits(torch.nn.Module):
    """Returns the loss and the logits it was computed from, as a Hugging Face model given labels does."""

    def __init__(self, gpt: torch.nn.Module) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, tokens, targets):
        from remat_pass.examples import lm_loss

        logits = self.gpt(tokens)
        return lm_loss(logits, targets), logits


def test_a_loss_returned_beside_its_logits_is_inside_the_plan(caplog):
    import logging

    import remat_pass

    from .models import GPT, tiny_gpt_config

    torch.manual_seed(0)
    model = _LossAndLogits(GPT(tiny_gpt_config()))
    tokens, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    with caplog.at_level(logging.WARNING, logger="remat_pass.planning.pipeline"):
        remat_pass.optimize(model, budget=0.9, budget_kind="peak", example_inputs=(tokens, targets))
    assert "not a scalar loss" not in caplog.text


def test_a_peak_budget_at_a_tiny_graphs_own_peak_names_the_headroom():
    """A graph smaller than the peak budget's headroom cannot be planned at its own peak: the refusal's
    minimum is above the un-rematerialized peak, and the message says why instead of leaving it a riddle."""
    import remat_pass
    from remat_pass import BudgetInfeasibleError

    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()), torch.randn(4, 8)
    own_peak = remat_pass.plan(model, (x,), budget=10**9, budget_kind="peak", plan_cache=False).predicted_peak_bytes
    with pytest.raises(BudgetInfeasibleError, match="headroom") as refused:
        remat_pass.plan(model, (x,), budget=own_peak, budget_kind="peak", plan_cache=False)
    assert refused.value.min_bytes > refused.value.keep_all_bytes == own_peak
