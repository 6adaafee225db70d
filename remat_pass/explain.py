"""Explain a plan without training: trace the step once, solve one budget, and say per module
what is kept, what is recomputed and what that costs.

>>> import torch, remat_pass.explain as rx
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
>>> explanation = rx.explain(model, (torch.randn(4, 8),), budget=0.5)
>>> explanation.plan.kept_bytes <= explanation.plan.keep_all_bytes // 2
True
>>> [row.module for row in explanation.rows]
['0', '1', '2']
>>> explanation.render()  # doctest: +SKIP

The step is traced by ``pipeline.trace_step`` (capture, annotate, one torch-free ``Problem`` for the
whole step, with its forward+backward FLOPs to put recompute in proportion) and planned by
``pipeline.plan_problem``, as ``sweep`` and ``plan`` do.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from remat_pass.solvers.problem import ModuleRow, Plan, format_bytes

from .budget import Budget, parse_budget
from .costs import DeviceProfile
from .pipeline import DEFAULT_TIME_LIMIT, BudgetKind, LossFn, PlanOptions, TracedStep, plan_problem, trace_step
from .report import format_flops

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.table import Table

@dataclass(frozen=True)
class Explanation:
    """A plan for one budget and its per-module account. ``render()`` prints it as a table.

    ``budget`` is the budget as given (parsed); ``plan.budget_bytes`` is what it resolved to.
    """

    plan: Plan
    budget: Budget
    step_flops: int
    depth: int | None = None

    @property
    def rows(self) -> list[ModuleRow]:
        return self.plan.per_module(self.depth)

    @property
    def flop_overhead(self) -> float:
        """Recomputed FLOPs as a fraction of the step's forward+backward FLOPs."""
        return self.plan.recompute_flops / self.step_flops if self.step_flops else 0.0

    def headline(self) -> str:
        plan = self.plan
        gap = "n/a" if plan.gap is None else f"{plan.gap:.2%}"
        budget = format_bytes(plan.budget_bytes) if plan.budget_bytes is not None else "none"
        return (
            f"Plan by {plan.solver} ({plan.status}, gap {gap}); budget {self.budget} = {budget}: "
            f"kept {format_bytes(plan.kept_bytes)} of {format_bytes(plan.keep_all_bytes)} "
            f"({plan.kept_fraction:.1%}); recompute ~{plan.recompute_seconds * 1e3:.3f} ms, "
            f"{format_flops(plan.recompute_flops)} (+{self.flop_overhead:.1%} of the step's "
            f"{format_flops(self.step_flops)})"
        )

    def table(self) -> Table:
        """The per-module rows and their totals as a ``rich`` table."""
        from rich.table import Table

        table = Table(caption="policy: none = recomputes nothing; full = keeps only what other modules "
                              "read; selective = keeps some of its own, recomputes others", caption_justify="left")
        table.add_column("module")
        table.add_column("policy")
        for header in ("kept", "recomputed", "keep-all", "recompute time", "recompute FLOPs"):
            table.add_column(header, justify="right")
        rows = self.rows
        for row in rows:
            table.add_row(row.module or "(top level)", row.policy, format_bytes(row.kept_bytes),
                          format_bytes(row.recomputed_bytes), format_bytes(row.keep_all_bytes),
                          f"{row.recompute_seconds * 1e3:.3f} ms", format_flops(row.recompute_flops),
                          end_section=row is rows[-1])
        plan = self.plan
        table.add_row("[bold]total[/]", "", format_bytes(plan.kept_bytes),
                      format_bytes(sum(r.recomputed_bytes for r in rows)), format_bytes(plan.keep_all_bytes),
                      f"{plan.recompute_seconds * 1e3:.3f} ms", format_flops(plan.recompute_flops))
        return table

    def __rich__(self) -> RenderableType:
        from rich.console import Group
        from rich.text import Text

        return Group(Text(self.headline()), self.table())

    def render(self, console: Console | None = None) -> None:
        """Print the headline and the table (to the terminal unless ``console`` says otherwise)."""
        from rich.console import Console

        (console or Console()).print(self)

    def __str__(self) -> str:
        from rich.console import Console

        buffer = io.StringIO()
        self.render(Console(file=buffer, width=120, no_color=True, highlight=False))
        return buffer.getvalue().rstrip("\n")

    def to_dict(self) -> dict[str, Any]:
        """``plan.to_dict(depth)`` plus the budget as asked, the step's FLOPs and the overhead ratio."""
        return {
            **self.plan.to_dict(self.depth),
            "budget": {"fraction": self.budget.fraction, "bytes": self.budget.nbytes},
            "step_flops": self.step_flops,
            "flop_overhead": self.flop_overhead,
        }


def explain_traced(
    traced: TracedStep,
    budget: object,
    solver: str = "ilp",
    *,
    depth: int | None = None,
    budget_kind: str = BudgetKind.AUTO,
    offload: bool = False,
    **solver_options: Any,
) -> Explanation:
    """``explain`` for a step already traced (``trace_step``); raises BudgetInfeasibleError.

    The budget means what it means for ``optimize`` (``budget_kind``: a fraction bounds saved
    bytes, an absolute size the step's peak, unless told otherwise).
    """
    parsed = parse_budget(budget)
    if depth is not None and depth < 1:
        raise ValueError(f"depth must be a positive number of path parts or None, got {depth}")
    time_limit = solver_options.pop("time_limit", DEFAULT_TIME_LIMIT)
    options = PlanOptions(parsed, solver, traced.problem.device, time_limit, budget_kind, solver_options,
                          offload=offload)
    plan = plan_problem(traced.problem, options).plan
    return Explanation(plan=plan, budget=parsed, step_flops=traced.step_flops, depth=depth)


def explain(
    model: nn.Module,
    example_inputs: Any,
    budget: object,
    solver: str = "ilp",
    device: str | DeviceProfile = "cpu",
    *,
    loss_fn: LossFn | None = None,
    depth: int | None = None,
    **solver_options: Any,
) -> Explanation:
    """Plan ``model``'s training step for ``budget`` and account for it module by module.

    Nothing is trained: the step is traced once (see ``trace_step``). ``budget`` as for
    ``optimize``; an impossible one raises BudgetInfeasibleError with the smallest feasible.
    ``solver`` is any name in ``solvers.SOLVERS``; ``device`` picks the cost model.
    """
    traced = trace_step(model, example_inputs, loss_fn=loss_fn, device=device)
    return explain_traced(traced, budget, solver, depth=depth, **solver_options)
