"""The exceptions remat_pass raises: one root, each also a fitting built-in type.

The planner-side types live in the torch-free ``solvers`` package and are re-exported here.
"""

from __future__ import annotations

from remat_pass.solvers.errors import (
    BudgetInfeasibleError,
    RematError,
    SolverError,
    SolverOptionError,
    SolverUnavailableError,
)

__all__ = [
    "RematError",
    "InvalidBudgetError",
    "BudgetInfeasibleError",
    "CaptureError",
    "SolverError",
    "SolverOptionError",
    "SolverUnavailableError",
]


class InvalidBudgetError(RematError, ValueError):
    """The budget is not a fraction in (0, 1], a positive byte count, or a size string."""


class CaptureError(RematError, RuntimeError):
    """The model could not be captured as a joint forward+backward graph."""
