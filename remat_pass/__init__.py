"""remat_pass: choose which activations to keep and which to recompute, under a memory budget.

>>> import remat_pass
>>> opt = remat_pass.optimize(model, budget=0.4)      # doctest: +SKIP
>>> loss_fn(opt(x)).backward()                       # doctest: +SKIP
>>> print(opt.plan)                                  # doctest: +SKIP

Names are imported on first use, so that torch-free tools (``remat-pass estimate``) start fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "optimize": "remat_pass.runtime.api",
    "RematModule": "remat_pass.runtime.api",
    "backend": "remat_pass.runtime.dynamo_backend",
    "DEFAULT_BUDGET": "remat_pass.planning.pipeline",
    "apply_to_blocks": "remat_pass.runtime.per_block",
    "ChunkLoss": "remat_pass.capture.loss_chunking",
    "parse_budget": "remat_pass.planning.budget",
    "saved_activation_bytes": "remat_pass.runtime.measure",
    "sweep": "remat_pass.tools.tradeoff",
    "plan": "remat_pass.planning.plan_model",
    "Plan": "remat_pass.solvers.problem",
    "RematError": "remat_pass.errors",
    "InvalidBudgetError": "remat_pass.errors",
    "BudgetInfeasibleError": "remat_pass.errors",
    "CaptureError": "remat_pass.errors",
    "SolverError": "remat_pass.errors",
    "SolverOptionError": "remat_pass.errors",
    "SolverUnavailableError": "remat_pass.errors",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from remat_pass.solvers.problem import Plan

    from .runtime.api import RematModule, optimize
    from .runtime.dynamo_backend import backend
    from .runtime.per_block import apply_to_blocks
    from .capture.loss_chunking import ChunkLoss
    from .planning.budget import parse_budget
    from .errors import (
        BudgetInfeasibleError,
        CaptureError,
        InvalidBudgetError,
        RematError,
        SolverError,
        SolverOptionError,
        SolverUnavailableError,
    )
    from .runtime.measure import saved_activation_bytes
    from .planning.pipeline import DEFAULT_BUDGET
    from .planning.plan_model import plan
    from .tools.tradeoff import sweep


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'remat_pass' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
