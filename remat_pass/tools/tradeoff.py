"""The memory/recompute trade-off of one model: trace once, plan for many budgets.

>>> import torch, remat_pass
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
>>> result = remat_pass.sweep(model, (torch.randn(4, 8),), budgets=(0.25, 0.5, 1.0))
>>> [point.status for point in result.points]
['optimal', 'optimal', 'optimal']
>>> sorted(point.solver for point in result.baselines)
['chen_sqrt', 'keep_all', 'per_block', 'recompute_all', 'selective']

Budgets no plan can meet are recorded (``status == "infeasible"``), not raised: a sweep is for
finding where the curve ends. ``remat_pass.tools.plots.plot_pareto(result, "pareto.png")`` draws it.
"""

from __future__ import annotations

import enum
import io
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from torch import nn

from remat_pass import solvers
from remat_pass.solvers.problem import Plan, Problem, format_bytes

from ..planning.budget import parse_budget
from ..annotate.costs import CostModel, DeviceProfile, parse_costs
from ..planning.pipeline import LossFn, TracedStep
from ..planning.repeated_blocks import trace_repeated
from .report import format_flops

if TYPE_CHECKING:
    from rich.table import Table

DEFAULT_BUDGETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0)
BASELINES = tuple(solvers.BASELINES)  # the registry's heuristics, in registration order


class CurveStatus(str, enum.Enum):
    """What a point on the curve says when it is not simply a plan's status (``solvers.Status``)."""

    INFEASIBLE = "infeasible"  # no plan meets this budget
    OVER_BUDGET = "over_budget"  # a heuristic's plan that keeps more than the budget
    HULL_VERTEX = "hull_vertex"  # a vertex of the fast planner's lower hull (see hull_points)

    def __str__(self) -> str:
        return self.value


INFEASIBLE, OVER_BUDGET = CurveStatus.INFEASIBLE, CurveStatus.OVER_BUDGET


@dataclass(frozen=True)
class SweepPoint:
    """One plan on the curve, or one budget no plan meets (then the plan's numbers are None).

    ``budget`` is as requested (a fraction or bytes; None for baselines, which ignore budgets).
    ``fraction`` is ``kept_bytes`` over keep-all; ``flop_overhead`` is the recomputed FLOPs
    over the step's forward+backward FLOPs.
    """

    solver: str
    budget: float | int | None
    budget_bytes: int | None
    status: str
    kept_bytes: int | None
    fraction: float | None
    recompute_seconds: float | None
    recompute_flops: int | None
    flop_overhead: float | None
    plan: Plan | None = field(default=None, repr=False, compare=False)

    @property
    def feasible(self) -> bool:
        return self.kept_bytes is not None

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in (
            "solver", "budget", "budget_bytes", "status", "kept_bytes", "fraction", "recompute_seconds",
            "recompute_flops", "flop_overhead")}


@dataclass(frozen=True)
class Sweep:
    """The trade-off curve (``points``, ascending budget) and the baselines, on one traced step."""

    problem: Problem = field(repr=False)
    solver: str
    keep_all_bytes: int
    min_feasible_bytes: int | None
    step_flops: int
    points: tuple[SweepPoint, ...]
    baselines: tuple[SweepPoint, ...]
    hull: tuple[SweepPoint, ...] = ()  # the whole curve's lower hull, when asked for (hull_points)

    def rows(self) -> list[dict[str, Any]]:
        """The curve as plain dicts: budget, kept_bytes, fraction, recompute_seconds, ..., status."""
        return [point.to_dict() for point in self.points]

    def to_dict(self) -> dict[str, Any]:
        return {
            "solver": self.solver,
            "device": self.problem.device,
            "keep_all_bytes": self.keep_all_bytes,
            "min_feasible_bytes": self.min_feasible_bytes,
            "step_flops": self.step_flops,
            "points": self.rows(),
            "baselines": [point.to_dict() for point in self.baselines],
            "hull": [point.to_dict() for point in self.hull],
        }

    def table(self) -> Table:
        from rich.table import Table

        table = Table(title=f"Trade-off by {self.solver}: keep-all {format_bytes(self.keep_all_bytes)}, "
                            f"step {format_flops(self.step_flops)}", title_justify="left")
        for header in ("solver", "budget", "kept", "fraction", "recompute", "FLOP overhead", "status"):
            table.add_column(header, justify="left" if header in ("solver", "status") else "right")
        for point in (*self.points, *self.baselines):
            budget = "-" if point.budget is None else (
                f"{point.budget:g}" if isinstance(point.budget, float) else format_bytes(point.budget))
            if point.feasible:
                numbers = (format_bytes(point.kept_bytes or 0), f"{point.fraction:.1%}",
                           f"{(point.recompute_seconds or 0) * 1e3:.3f} ms", f"{point.flop_overhead:.2%}")
            else:
                numbers = ("-",) * 4
            table.add_row(point.solver, budget, *numbers, point.status, end_section=point is self.points[-1])
        return table

    def __str__(self) -> str:
        from rich.console import Console

        buffer = io.StringIO()
        Console(file=buffer, width=120, no_color=True, highlight=False).print(self.table())
        return buffer.getvalue().rstrip("\n")


def _point(plan: Plan, budget: float | int | None, step_flops: int) -> SweepPoint:
    over = plan.budget_bytes is not None and plan.kept_bytes > plan.budget_bytes
    return SweepPoint(
        solver=plan.solver, budget=budget, budget_bytes=plan.budget_bytes,
        status=OVER_BUDGET if over else plan.status, kept_bytes=plan.kept_bytes, fraction=plan.kept_fraction,
        recompute_seconds=plan.recompute_seconds, recompute_flops=plan.recompute_flops,
        flop_overhead=plan.recompute_flops / step_flops if step_flops else 0.0, plan=plan)


def _infeasible(solver: str, budget: float | int, budget_bytes: int) -> SweepPoint:
    return SweepPoint(solver, budget, budget_bytes, INFEASIBLE, None, None, None, None, None)


def _progress(enabled: bool | None) -> Any:
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    return Progress(console=console, transient=True,
                    disable=not (console.is_terminal if enabled is None else enabled))


def sweep_traced(
    traced: TracedStep,
    budgets: Iterable[object] = DEFAULT_BUDGETS,
    solver: str = "ilp",
    *,
    baselines: Iterable[str] = BASELINES,
    progress: bool | None = None,
    hull: bool = False,
    **solver_options: Any,
) -> Sweep:
    """``sweep`` for a step already traced (``pipeline.trace_step``); ``hull=True`` adds ``hull_points``."""
    problem = traced.problem
    solvers.get_solver(solver)  # an unknown name is a ValueError naming the choices
    keep_all_bytes = problem.keep_all_bytes()
    parsed = [parse_budget(budget) for budget in budgets]
    requested = sorted(
        ((b.fraction if b.fraction is not None else b.nbytes, b.resolve(keep_all_bytes)) for b in parsed),
        key=lambda pair: pair[1])
    baselines = tuple(baselines)
    minimum = None
    if solver == "ilp" and any(nbytes < keep_all_bytes for _, nbytes in requested):
        minimum = solvers.min_feasible_bytes(problem, **_min_bytes_options(solver_options))
    points: list[SweepPoint] = []
    with _progress(progress) as bar:
        task = bar.add_task(f"planning with {solver}", total=len(requested) + len(baselines))
        for budget, nbytes in requested:
            if minimum is not None and nbytes < minimum:
                points.append(_infeasible(solver, budget, nbytes))
            else:
                try:
                    plan = solvers.solve(problem, nbytes, solver=solver, **solver_options)
                except solvers.BudgetInfeasibleError:
                    points.append(_infeasible(solver, budget, nbytes))
                else:
                    points.append(_point(plan, budget, traced.step_flops))
            bar.advance(task)
        reference = []
        for name in baselines:
            reference.append(_point(solvers.solve(problem, None, solver=name), None, traced.step_flops))
            bar.advance(task)
    time_limit = solver_options.get("time_limit", solvers.DEFAULT_TIME_LIMIT)
    lower = hull_points(problem, traced.step_flops, time_limit=time_limit) if hull else ()
    return Sweep(problem=problem, solver=solver, keep_all_bytes=keep_all_bytes, min_feasible_bytes=minimum,
                 step_flops=traced.step_flops, points=tuple(points), baselines=tuple(reference), hull=lower)


def hull_points(problem: Problem, step_flops: int = 0, *, time_limit: float = solvers.DEFAULT_TIME_LIMIT,
                blocks: bool = True) -> tuple[SweepPoint, ...]:
    """The whole trade-off curve at once, as sweep points (ascending kept bytes, ``budget`` None).

    The vertices of the fast planner's lower convex hull of (kept bytes, recompute seconds)
    (``solvers.fast.tradeoff_hull``): each is the least recompute time for its own bytes where
    the planner's cut model is exact, and between vertices the hull is a lower bound on what any
    budget there costs; status ``hull_vertex``. One cut per vertex, so deep models are cheap;
    ``sweep`` solves named budgets, this draws the frontier they lie on.
    """
    from remat_pass.solvers.fast import tradeoff_hull

    keep_all = problem.keep_all_bytes()
    return tuple(
        SweepPoint(solver="hull", budget=None, budget_bytes=vertex.kept_bytes, status=CurveStatus.HULL_VERTEX,
                   kept_bytes=vertex.kept_bytes, fraction=vertex.kept_bytes / keep_all if keep_all else 0.0,
                   recompute_seconds=vertex.recompute_seconds, recompute_flops=vertex.recompute_flops,
                   flop_overhead=vertex.recompute_flops / step_flops if step_flops else 0.0)
        for vertex in reversed(tradeoff_hull(problem, blocks=blocks, time_limit=time_limit)))


def _min_bytes_options(options: dict[str, Any]) -> dict[str, Any]:
    return {key: options[key] for key in ("time_limit", "backend", "threads") if key in options}


def sweep(
    model: nn.Module,
    example_inputs: Any,
    budgets: Iterable[object] = DEFAULT_BUDGETS,
    solver: str = "ilp",
    device: str | DeviceProfile = "auto",
    loss_fn: LossFn | None = None,
    *,
    baselines: Iterable[str] = BASELINES,
    progress: bool | None = None,
    hull: bool = False,
    costs: str = CostModel.ROOFLINE,
    **solver_options: Any,
) -> Sweep:
    """Trace ``model``'s training step once and plan it for every budget, plus the baselines
    (and, with ``hull=True``, the lower hull of the whole curve: ``hull_points``).

    ``budgets``: fractions of keep-all and/or byte sizes, as for ``optimize`` (an invalid one
    raises InvalidBudgetError before anything is solved). ``loss_fn(output, *example_inputs)``
    makes the loss part of the traced step. ``progress``: a progress bar on stderr (None: only
    when stderr is a terminal). ``solver_options`` go to the solver (e.g. ``time_limit``).
    ``costs`` prices recompute as for ``optimize`` ("roofline", "flops", "measure").
    """
    # A stack of identical blocks is traced 4 blocks deep and stamped (planning.repeated_blocks).
    traced = trace_repeated(model, example_inputs, loss_fn=loss_fn, device=device, costs=parse_costs(costs))
    return sweep_traced(traced, budgets, solver, baselines=baselines, progress=progress, hull=hull, **solver_options)
