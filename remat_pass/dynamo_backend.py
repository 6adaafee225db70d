"""The ``torch.compile`` backend: capture -> annotate -> solve -> rewrite, per subgraph.

``torch.compile(model, backend="remat")`` uses the default budget (see ``DEFAULT_BUDGET``);
``torch.compile(model, backend=remat_pass.backend(budget="1GiB", inner="inductor"))`` chooses.
The name "remat" is registered through the ``torch_dynamo_backends`` entry point in
pyproject.toml, which is how torch discovers third-party backends.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import fx

import solvers
from solvers.problem import Plan

from .annotate import annotate
from .budget import Budget, parse_budget
from .capture import INNER_COMPILERS, JointGraph, make_dynamo_backend
from .costs import DeviceProfile
from .rewrite import rewrite

logger = logging.getLogger(__name__)

DEFAULT_BUDGET = 0.5
"""Half the activation bytes: usually attainable by recomputing only cheap ops."""


@dataclass(frozen=True)
class PlanOptions:
    """How plans are made. ``device`` picks the cost model ("cpu", "a100", "h100", "h200")."""

    budget: Budget
    solver: str = "ilp"
    device: str | DeviceProfile = "cpu"
    time_limit: float = 60.0
    solver_options: dict[str, Any] = field(default_factory=dict)


def plan_joint_graph(joint: JointGraph, options: PlanOptions) -> tuple[Plan, fx.GraphModule, fx.GraphModule]:
    """The whole pipeline for one joint graph: the plan and the two rewritten graphs."""
    started = time.perf_counter()
    annotated = annotate(joint, options.device)
    budget_bytes = options.budget.resolve(annotated.problem.keep_all_bytes())
    extra = dict(options.solver_options)
    if options.solver == "ilp":
        extra.setdefault("time_limit", options.time_limit)
    plan = solvers.solve(annotated.problem, budget_bytes, solver=options.solver, **extra)
    forward, backward = rewrite(annotated, plan)
    logger.info(
        "planned %d forward values in %.2fs: keep %d of %d bytes, recompute %d values (%s, %s)",
        len(annotated.problem.values), time.perf_counter() - started, plan.kept_bytes,
        plan.keep_all_bytes, len(plan.recomputed), plan.solver, plan.status,
    )
    return plan, forward, backward


class RematBackend:
    """A dynamo backend object; it remembers the plan of every subgraph it compiled.

    ``plans`` lists them in compile order. ``on_plan`` (used by ``optimize``) is called with
    each new plan as soon as it exists.
    """

    def __init__(
        self,
        budget: object = DEFAULT_BUDGET,
        *,
        inner: str = "eager",
        solver: str = "ilp",
        device: str | DeviceProfile = "cpu",
        time_limit: float = 60.0,
        on_plan: Callable[[Plan], None] | None = None,
        **solver_options: Any,
    ) -> None:
        if inner not in INNER_COMPILERS:
            raise ValueError(f"inner must be one of {INNER_COMPILERS}, got {inner!r}")
        if solver not in solvers.SOLVERS:
            raise ValueError(f"unknown solver {solver!r}; choose one of {sorted(solvers.SOLVERS)}")
        self.options = PlanOptions(parse_budget(budget), solver, device, time_limit, solver_options)
        self.inner = inner
        self.plans: list[Plan] = []
        self._on_plan = on_plan
        self._lock = threading.Lock()
        self._compile = make_dynamo_backend(self._partition, inner)

    def _partition(self, joint: JointGraph) -> tuple[fx.GraphModule, fx.GraphModule]:
        plan, forward, backward = plan_joint_graph(joint, self.options)
        with self._lock:
            self.plans.append(plan)
        if self._on_plan is not None:
            self._on_plan(plan)
        return forward, backward

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        return self._compile(gm, example_inputs)

    def __repr__(self) -> str:
        return f"RematBackend(budget={self.options.budget}, inner={self.inner!r}, solver={self.options.solver!r})"


def backend(budget: object = DEFAULT_BUDGET, *, inner: str = "eager", **options: Any) -> RematBackend:
    """A ``torch.compile`` backend with a budget.

    >>> import torch, remat_pass
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    >>> compiled = torch.compile(model, backend=remat_pass.backend(budget=0.5))
    >>> compiled(torch.randn(2, 8)).sum().backward()
    """
    return RematBackend(budget, inner=inner, **options)


def remat_backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
    """The registered "remat" backend: default budget, eager inner compiler."""
    return RematBackend(DEFAULT_BUDGET)(gm, example_inputs)
