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
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from torch import fx

from remat_pass import solvers
from remat_pass.solvers.problem import Plan

from .annotate import annotate
from .budget import Budget, parse_budget
from .capture import INNER_COMPILERS, JointGraph, make_dynamo_backend
from .costs import DeviceProfile
from .errors import RematError
from .rewrite import rewrite
from .simulate import simulate

logger = logging.getLogger(__name__)

DEFAULT_BUDGET = 0.5
"""Half the activation bytes: usually attainable by recomputing only cheap ops."""


BUDGET_KINDS = ("auto", "saved", "peak")


def resolve_budget_kind(budget: Budget, kind: str) -> str:
    """"auto": a fraction bounds saved bytes, an absolute size bounds the step's peak.

    A fraction is relative to what the un-rematerialized step saves, so "saved" is what it
    naturally means; an absolute size is what a user's device can hold, so it must bound the
    peak — a bound on saved bytes alone can be met by a plan that peaks higher.
    """
    if kind not in BUDGET_KINDS:
        raise ValueError(f"budget_kind must be one of {BUDGET_KINDS}, got {kind!r}")
    if kind != "auto":
        return kind
    return "saved" if budget.fraction is not None else "peak"


@dataclass(frozen=True)
class PlanOptions:
    """How plans are made. ``device`` picks the cost model ("cpu", "a100", "h100", "h200");
    ``budget_kind`` says what the budget bounds ("auto", "saved", "peak")."""

    budget: Budget
    solver: str = "ilp"
    device: str | DeviceProfile = "cpu"
    time_limit: float = 60.0
    budget_kind: str = "auto"
    solver_options: dict[str, Any] = field(default_factory=dict)
    free_inputs: bool = False  # see annotate(): True only when each graph is a whole step
    # The default budget is a preference, not a user's promise: when a graph cannot meet it,
    # plan at the smallest feasible budget instead of failing the compile (and say so).
    clamp_to_feasible: bool = False


# A peak budget is planned with headroom for what the graphs do not show: scratch space inside
# kernels (e.g. a bool mask cast to float inside a multiplication), the allocator's rounding and
# the few small tensors the autograd runtime allocates around the graphs. On CPU transformer
# steps the allocator's peak exceeded the simulated one by a few percent at most (tests/test_peak.py
# checks 5%); convolution kernels exceed it by more (benchmarks/RESULTS.md, ResNet).
PEAK_HEADROOM_FRACTION = 0.03
PEAK_HEADROOM_BYTES = 4 * 1024


def _without_headroom(budget_bytes: int) -> int:
    return max(int(budget_bytes * (1 - PEAK_HEADROOM_FRACTION)) - PEAK_HEADROOM_BYTES, 1)


def _with_headroom(planned_bytes: int) -> int:
    """The smallest budget whose headroom-reduced value is ``planned_bytes`` or more."""
    budget = int((planned_bytes + PEAK_HEADROOM_BYTES) / (1 - PEAK_HEADROOM_FRACTION))
    while _without_headroom(budget) < planned_bytes:
        budget += 1
    return budget


def plan_problem(problem: solvers.Problem, options: PlanOptions) -> Plan:
    """Resolve the budget against ``problem`` and solve; the plan carries its predicted peak."""
    try:
        return _plan_problem(problem, options)
    except solvers.BudgetInfeasibleError as error:
        if not options.clamp_to_feasible:
            raise
        logger.warning("the default budget (%s) is infeasible for this graph; planning at the smallest "
                       "feasible budget, %d bytes", options.budget, error.min_bytes)
        kind = resolve_budget_kind(options.budget, options.budget_kind)
        return _plan_problem(problem, replace(options, budget=Budget(nbytes=error.min_bytes), budget_kind=kind))


def _plan_problem(problem: solvers.Problem, options: PlanOptions) -> Plan:
    kind = resolve_budget_kind(options.budget, options.budget_kind)
    extra = dict(options.solver_options)
    solver = options.solver
    if solver in ("ilp", "fast") and kind == "peak":
        extra["cap_solver"] = solver  # the peak search solves saved-bytes caps with this solver
        solver = "ilp_peak"
    if solver in ("ilp", "ilp_peak", "fast"):
        extra.setdefault("time_limit", options.time_limit)
    if kind == "peak":
        keep_all_peak = solvers.simulate_plan(problem, solvers.solve(problem, None, solver="keep_all")).peak_bytes
        budget_bytes = options.budget.resolve(keep_all_peak)
        try:
            plan = solvers.solve(problem, _without_headroom(budget_bytes), solver=solver, **extra)
        except solvers.BudgetInfeasibleError as error:
            raise solvers.BudgetInfeasibleError(
                budget_bytes, _with_headroom(error.min_bytes), keep_all_peak, kind="peak") from None
        plan = replace(plan, budget_bytes=budget_bytes)
    else:
        budget_bytes = options.budget.resolve(problem.keep_all_bytes())
        plan = solvers.solve(problem, budget_bytes, solver=solver, **extra)
    if plan.predicted_peak_bytes is None:
        plan = replace(plan, predicted_peak_bytes=solvers.simulate_plan(problem, plan).peak_bytes)
    return plan


def plan_joint_graph(joint: JointGraph, options: PlanOptions) -> tuple[Plan, fx.GraphModule, fx.GraphModule]:
    """The whole pipeline for one joint graph: the plan and the two rewritten graphs.

    The rewritten graphs are replayed by the graph-level simulator as an independent check of
    the plan-level peak prediction; a peak budget the graphs would break is an error, never a
    silent overshoot.
    """
    started = time.perf_counter()
    annotated = annotate(joint, options.device, free_inputs=options.free_inputs)
    plan = plan_problem(annotated.problem, options)
    forward, backward = rewrite(annotated, plan)
    simulated = simulate(forward, backward).peak_bytes
    for _ in range(3):  # the two models disagree by a few bytes at most; re-plan with the margin
        if plan.budget_kind != "peak" or plan.budget_bytes is None or simulated <= plan.budget_bytes:
            break
        margin = simulated - (plan.predicted_peak_bytes or simulated)
        logger.info("graph-level peak %d over the %d-byte budget; re-planning %d bytes lower",
                    simulated, plan.budget_bytes, max(margin, 1))
        tighter = replace(options, budget=Budget(nbytes=max(plan.budget_bytes - max(margin, 1), 1)),
                          budget_kind="peak")
        plan = replace(plan_problem(annotated.problem, tighter), budget_bytes=plan.budget_bytes)
        forward, backward = rewrite(annotated, plan)
        simulated = simulate(forward, backward).peak_bytes
    if plan.budget_kind == "peak" and plan.budget_bytes is not None and simulated > plan.budget_bytes:
        raise RematError(
            f"internal error: the rewritten graphs peak at {simulated} bytes, over the {plan.budget_bytes}-byte "
            f"budget (plan-level prediction {plan.predicted_peak_bytes}); please report it"
        )
    if simulated != plan.predicted_peak_bytes:
        logger.debug("graph-level peak %d vs plan-level %s", simulated, plan.predicted_peak_bytes)
    logger.info(
        "planned %d forward values in %.2fs: keep %d of %d bytes, recompute %d values, peak ~%d bytes (%s, %s)",
        len(annotated.problem.values), time.perf_counter() - started, plan.kept_bytes,
        plan.keep_all_bytes, len(plan.recomputed), simulated, plan.solver, plan.status,
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
        budget_kind: str = "auto",
        on_plan: Callable[[Plan], None] | None = None,
        free_inputs: bool = False,
        **solver_options: Any,
    ) -> None:
        if inner not in INNER_COMPILERS:
            raise ValueError(f"inner must be one of {INNER_COMPILERS}, got {inner!r}")
        if solver not in solvers.SOLVERS:
            raise ValueError(f"unknown solver {solver!r}; choose one of {sorted(solvers.SOLVERS)}")
        parsed = parse_budget(budget)
        resolve_budget_kind(parsed, budget_kind)  # reject a bad kind now, not at the first call
        self.options = PlanOptions(parsed, solver, device, time_limit, budget_kind, solver_options, free_inputs)
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
    """The registered "remat" backend: the default budget (or the smallest feasible one, where
    a graph cannot meet it), eager inner compiler."""
    backend = RematBackend(DEFAULT_BUDGET)
    backend.options = replace(backend.options, clamp_to_feasible=True)
    return backend(gm, example_inputs)
