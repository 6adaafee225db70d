"""remat_pass: choose which activations to keep and which to recompute, under a memory budget.

>>> import remat_pass
>>> opt = remat_pass.optimize(model, budget=0.4)      # doctest: +SKIP
>>> loss_fn(opt(x)).backward()                       # doctest: +SKIP
>>> print(opt.plan)                                  # doctest: +SKIP
"""

from solvers.problem import Plan

from .api import RematModule, optimize
from .backend import DEFAULT_BUDGET, backend
from .budget import parse_budget
from .errors import (
    BudgetInfeasibleError,
    CaptureError,
    InvalidBudgetError,
    RematError,
    SolverError,
    SolverUnavailableError,
)
from .measure import saved_activation_bytes

__all__ = [
    "optimize",
    "backend",
    "Plan",
    "RematModule",
    "DEFAULT_BUDGET",
    "parse_budget",
    "saved_activation_bytes",
    "RematError",
    "InvalidBudgetError",
    "BudgetInfeasibleError",
    "CaptureError",
    "SolverError",
    "SolverUnavailableError",
]
