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

``trace_step`` is the shared first half (``sweep`` uses it too): capture, annotate, and one torch-free
``Problem`` for the whole step, with the step's forward+backward FLOPs to put recompute in proportion.
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn

from remat_pass.solvers.problem import ModuleRow, Plan, Problem, format_bytes

from .annotate import META_KEY, AnnotatedGraph, annotate
from .budget import Budget, parse_budget
from .capture import capture
from .costs import DeviceProfile

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.table import Table

LossFn = Callable[..., torch.Tensor]
_WRAPPED = "model"  # attribute under which _WithLoss holds the user's model


@dataclass(frozen=True)
class TracedStep:
    """One traced training step: the planning problem and the step's total FLOPs.

    ``step_flops`` adds the FLOP counts annotate put on every joint-graph node, forward and
    backward (matmuls and attention; pointwise ops count 0). ``pieces`` is the number of graphs
    between graph breaks; several are planned as one problem, since their saved activations are
    alive together (the ``torch.compile`` backend, by contrast, gives each piece the budget).
    ``annotated`` holds each piece's annotated joint graph (to rewrite or simulate a plan; with one
    piece, the problem's value ids are that graph's).
    """

    problem: Problem
    step_flops: int
    pieces: int = 1
    annotated: tuple[AnnotatedGraph, ...] = field(default=(), repr=False, compare=False)


class _WithLoss(nn.Module):
    """model + loss in one forward, so the loss's saved tensors are planned too."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        setattr(self, _WRAPPED, model)
        self.loss_fn = loss_fn

    def forward(self, *inputs: Any) -> torch.Tensor:
        return self.loss_fn(getattr(self, _WRAPPED)(*inputs), *inputs)


def as_inputs(example_inputs: Any) -> tuple[Any, ...]:
    """A tuple of inputs: a tuple or list as given, anything else (one tensor) as a 1-tuple."""
    return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


def trace_step(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: LossFn | None = None,
    device: str | DeviceProfile = "cpu",
) -> TracedStep:
    """Capture and annotate one training step of ``model``; nothing is trained or modified.

    ``loss_fn(output, *example_inputs)``, when given, becomes part of the traced step; its
    values are planned too and belong to no module (``""``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    inputs = as_inputs(example_inputs)
    target = model if loss_fn is None else _WithLoss(model, loss_fn)
    annotated = [annotate(joint, device) for joint in capture(target, inputs)]
    step_flops = sum(
        node.meta[META_KEY].flops for a in annotated for node in a.joint.module.graph.nodes if META_KEY in node.meta
    )
    problem = _merge([a.problem for a in annotated])
    if loss_fn is not None:
        problem = _strip_wrapper(problem)
    return TracedStep(problem=problem, step_flops=step_flops, pieces=len(annotated), annotated=tuple(annotated))


def _merge(problems: Sequence[Problem]) -> Problem:
    """Several independent graphs as one problem: ids and storages renumbered, names prefixed."""
    if len(problems) == 1:
        return problems[0]
    values, storage_bytes, reads, outputs, steps = [], [], set(), set(), []
    for piece, problem in enumerate(problems):
        first_id, first_storage = len(values), len(storage_bytes)
        for value in problem.values:
            values.append(dataclasses.replace(
                value, id=value.id + first_id, name=f"g{piece}.{value.name}",
                inputs=tuple(i + first_id for i in value.inputs), storage=value.storage + first_storage))
        storage_bytes.extend(problem.storage_bytes)
        reads.update(i + first_id for i in problem.backward_reads)
        outputs.update(i + first_id for i in problem.forward_outputs)
        # Backward runs the pieces in reverse order.
        steps[:0] = [dataclasses.replace(step, reads=tuple(i + first_id for i in step.reads))
                     for step in problem.backward_steps]
    return Problem(tuple(values), tuple(storage_bytes), frozenset(reads), device=problems[0].device,
                   forward_outputs=frozenset(outputs), backward_steps=tuple(steps))


def _strip_wrapper(problem: Problem) -> Problem:
    """Module paths as the user's model names them, without _WithLoss's attribute."""

    def strip(path: str) -> str:
        return "" if path == _WRAPPED else path.removeprefix(_WRAPPED + ".")

    values = tuple(dataclasses.replace(v, module=strip(v.module)) for v in problem.values)
    return dataclasses.replace(problem, values=values)


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


def format_flops(count: float) -> str:
    """Readable FLOP count: 2048 -> '2.05 kFLOP'."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(count) >= scale:
            return f"{count / scale:.3g} {prefix}FLOP"
    return f"{count:.0f} FLOP"


def explain_traced(
    traced: TracedStep,
    budget: object,
    solver: str = "ilp",
    *,
    depth: int | None = None,
    budget_kind: str = "auto",
    **solver_options: Any,
) -> Explanation:
    """``explain`` for a step already traced (``trace_step``); raises BudgetInfeasibleError.

    The budget means what it means for ``optimize`` (``budget_kind``: a fraction bounds saved
    bytes, an absolute size the step's peak, unless told otherwise).
    """
    from .dynamo_backend import PlanOptions, plan_problem

    parsed = parse_budget(budget)
    if depth is not None and depth < 1:
        raise ValueError(f"depth must be a positive number of path parts or None, got {depth}")
    time_limit = solver_options.pop("time_limit", 60.0)
    options = PlanOptions(parsed, solver, traced.problem.device, time_limit, budget_kind, solver_options)
    plan = plan_problem(traced.problem, options)
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
