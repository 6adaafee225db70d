"""The ``torch.compile`` backend: each captured joint graph goes through ``pipeline.plan_joint_graph``.

``torch.compile(model, backend="remat")`` uses the default budget (see ``DEFAULT_BUDGET``);
``torch.compile(model, backend=remat_pass.backend(budget="1GiB", inner="inductor"))`` chooses.
The name "remat" is registered through the ``torch_dynamo_backends`` entry point in
pyproject.toml, which is how torch discovers third-party backends.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any, Callable

from torch import fx

from remat_pass import solvers
from remat_pass.solvers.problem import Plan

from .budget import parse_budget
from .capture import INNER_COMPILERS, JointGraph, make_dynamo_backend
from .costs import DeviceProfile
from .offload import check_offload_options, parse_host_budget
from .pipeline import DEFAULT_BUDGET, DEFAULT_TIME_LIMIT, BudgetKind, PlanOptions, plan_joint_graph, resolve_budget_kind

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
        time_limit: float = DEFAULT_TIME_LIMIT,
        budget_kind: str = BudgetKind.AUTO,
        on_plan: Callable[[Plan], None] | None = None,
        free_inputs: bool = False,
        offload: bool = False,
        host_budget: object = None,
        **solver_options: Any,
    ) -> None:
        if inner not in INNER_COMPILERS:
            raise ValueError(f"inner must be one of {INNER_COMPILERS}, got {inner!r}")
        if solver not in solvers.SOLVERS:
            raise ValueError(f"unknown solver {solver!r}; choose one of {sorted(solvers.SOLVERS)}")
        parsed = parse_budget(budget)
        resolve_budget_kind(parsed, budget_kind)  # reject a bad kind now, not at the first call
        check_offload_options(offload, device, solver)
        self.options = PlanOptions(parsed, solver, device, time_limit, budget_kind, solver_options, free_inputs,
                                   offload=offload, host_budget_bytes=parse_host_budget(host_budget))
        self.inner = inner
        self.plans: list[Plan] = []
        self._on_plan = on_plan
        self._lock = threading.Lock()
        self._compile = make_dynamo_backend(self._partition, inner)

    def _partition(self, joint: JointGraph) -> tuple[fx.GraphModule, fx.GraphModule]:
        planned = plan_joint_graph(joint, self.options)
        with self._lock:
            self.plans.append(planned.plan)
        if self._on_plan is not None:
            self._on_plan(planned.plan)
        return planned.forward, planned.backward

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
    """The registered "remat" backend: the default budget (or the smallest feasible one, where
    a graph cannot meet it), eager inner compiler."""
    backend = RematBackend(DEFAULT_BUDGET)
    backend.options = replace(backend.options, clamp_to_feasible=True)
    return backend(gm, example_inputs)
