"""The error hierarchy shared by the planners and the torch side.

It lives here, in the torch-free package, so that planners can raise the same types that
``remat_pass`` users catch; ``remat_pass.errors`` re-exports all of them.
"""

from __future__ import annotations


class RematError(Exception):
    """Root of every error remat_pass raises on purpose."""


class BudgetInfeasibleError(RematError, ValueError):
    """No plan keeps at most the budget; says the smallest budget that would work.

    For saved bytes ("saved") ``min_bytes`` is proven (``min_feasible_bytes``). For the peak
    ("peak") it is the lowest peak the search found, which a plan it did not try might beat;
    ``proven_min_bytes``, when given, is a bound no plan can go below (e.g. the working set the
    step needs whatever is kept), and the message says both. ``lowest_kept_bytes``: what the plan
    with that lowest peak keeps for backward, where known (a caller that plans the pieces of one step
    in turn reserves it for this graph). ``headroom_bytes``: what the caller adds to every planned peak
    (the message says so where that puts the minimum above the un-rematerialized step's peak).
    """

    def __init__(self, budget_bytes: int, min_bytes: int, keep_all_bytes: int, kind: str = "saved", *,
                 proven_min_bytes: int | None = None, input_bytes: int = 0,
                 lowest_kept_bytes: int | None = None, headroom_bytes: int = 0) -> None:
        self.budget_bytes = budget_bytes
        self.lowest_kept_bytes = lowest_kept_bytes
        self.min_bytes = min_bytes
        self.keep_all_bytes = keep_all_bytes
        self.kind = kind
        self.proven_min_bytes = proven_min_bytes
        self.input_bytes = input_bytes
        fraction = min_bytes / keep_all_bytes if keep_all_bytes else 0.0
        if kind == "peak":
            floor = ("" if proven_min_bytes is None else
                     f" No plan can peak below {proven_min_bytes} bytes; between the two, a plan may exist that "
                     "the search did not find.")
            if headroom_bytes and min_bytes > keep_all_bytes:
                floor += (f" Every peak budget keeps {headroom_bytes} bytes of headroom for the runtime's own small "
                          "tensors, more than this graph could give up.")
            message = (
                f"no plan found whose simulated peak fits the budget of {budget_bytes} bytes: the lowest peak "
                f"remat_pass found for this graph is {min_bytes} bytes ({fraction:.4f} of the {keep_all_bytes}-byte "
                f"peak of the un-rematerialized step).{floor} Pass budget={min_bytes} or more."
            )
        elif input_bytes:  # a graph piece: a fraction is of what it keeps beyond its own inputs
            reducible = keep_all_bytes - input_bytes
            fraction = (min_bytes - input_bytes) / reducible if reducible > 0 else 0.0
            message = (
                f"budget of {budget_bytes} bytes cannot be met: the smallest feasible budget for this graph is "
                f"{min_bytes} bytes: its own inputs ({input_bytes} bytes, kept in every plan) and "
                f"{fraction:.4f} of the {reducible} bytes the un-rematerialized step keeps beyond them. Pass "
                f"budget={min_bytes} or budget={_ceil_fraction(fraction)} or more."
            )
        else:
            message = (
                f"budget of {budget_bytes} bytes cannot be met: the smallest feasible budget for this graph is "
                f"{min_bytes} bytes ({fraction:.4f} of the {keep_all_bytes} bytes the un-rematerialized step "
                f"keeps). Pass budget={min_bytes} or budget={_ceil_fraction(fraction)} or more."
            )
        super().__init__(message)


class SolverError(RematError, RuntimeError):
    """The solver ran but produced no usable plan (time limit without incumbent, crash)."""


class SolverUnavailableError(RematError, ImportError):
    """The requested solver backend is not installed or its binary is broken."""


class SolverOptionError(RematError, TypeError):
    """An option the chosen planner does not take (``optimize(..., exact_share=...)`` with a
    saved-bytes budget, whose planner has no exact rows): named, with the options it does take."""


def _ceil_fraction(fraction: float) -> float:
    """Round a fraction up at 4 decimals so that the suggested budget is itself feasible."""
    scaled = fraction * 10_000
    whole = int(scaled)
    return (whole + (scaled > whole)) / 10_000
