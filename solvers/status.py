"""The planners' vocabulary: what a plan's status claims, what its budget bounds, how far from proven.

``str`` enums (like torch's ``CheckpointPolicy``), so a status compares equal to its plain string,
formats as that string and serializes to JSON as it.
"""

from __future__ import annotations

import enum

# Seconds a planner may spend when the caller does not say (all its backend runs together).
DEFAULT_TIME_LIMIT = 60.0
# A relative gap this small counts as closed.
CLOSED_GAP = 1e-9


class Status(enum.StrEnum):
    """What a plan's cost is known to be.

    ``OPTIMAL``: proven least recompute time within the budget (``gap`` 0). ``FEASIBLE``: within
    the budget, not proven; ``gap`` is the relative distance to a proven lower bound when one is
    known. ``TIME_LIMIT``: like ``FEASIBLE``, but the planner stopped because its time limit ran
    out (or a backend run had to be abandoned at it).
    """

    OPTIMAL = "optimal"
    FEASIBLE = "feasible"
    TIME_LIMIT = "time_limit"


class BudgetKind(enum.StrEnum):
    """What a budget bounds: the bytes saved for backward, or the simulated activation peak."""

    SAVED = "saved"
    PEAK = "peak"


def relative_gap(value: float, bound: float | None) -> float | None:
    """``(value - bound) / value``, at least 0; None when no bound is known; 0 for a free plan."""
    if bound is None:
        return None
    if value <= 0:
        return 0.0
    return max(0.0, (value - bound) / value)


__all__ = ["CLOSED_GAP", "DEFAULT_TIME_LIMIT", "BudgetKind", "Status", "relative_gap"]
