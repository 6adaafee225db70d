"""One account of a plan, three renderings: plain text, a ``rich`` table, a JSON-ready dict.

``explain`` and ``plan(verbose=True)`` / ``plan_with_report`` build the same ``PlanReport`` (a
plan plus what the traced step adds: its FLOPs and forward time, the budget as the user gave it)
and render it; there is no second formatter of the plan header.

``Plan.summary()`` (in the torch-free ``solvers``) stays the planners' own minimal text: it lists
values (largest kept, costliest recomputed), not modules, needs no traced step, and keeps the
planners free of any dependency on the torch side of the package.
"""

from __future__ import annotations

import io
from collections import Counter
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from remat_pass.solvers.baselines import block_of
from remat_pass.solvers.module_account import ModuleRow
from remat_pass.solvers.problem import STEP_IN_FORWARDS, Plan, Problem, format_bytes
from remat_pass.solvers.status import BudgetKind

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.table import Table

    from ..planning.budget import Budget

POLICY_CAPTION = ("policy: none = recomputes nothing; full = keeps only what other modules read; "
                  "selective = keeps some of its own, recomputes others")


def format_flops(count: float) -> str:
    """Readable FLOP count: 2048 -> '2.05 kFLOP'."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(count) >= scale:
            return f"{count / scale:.3g} {prefix}FLOP"
    return f"{count:.0f} FLOP"


def block_depth(problem: Problem) -> int | None:
    """How many path parts name a repeated block ("model.layers.12" -> 3); None without blocks."""
    prefixes = Counter(block_of(v.module) for v in problem.values if v.module)
    prefixes.pop(None, None)
    if not prefixes:
        return None
    common = Counter(len(p.split(".")) for p in prefixes)
    return common.most_common(1)[0][0]


@dataclass(frozen=True)
class PlanReport:
    """A plan and what the traced step adds to it, to put recompute in proportion.

    ``budget`` is the budget as given (parsed; None when unknown); ``plan.budget_bytes`` is what it
    resolved to. ``depth`` is how many module-path parts the rows keep (None: innermost modules;
    ``plan_with_report`` picks the depth of the repeated blocks). ``forward_seconds`` (the cost
    model's forward time) adds an estimate of the overhead in step time.
    """

    plan: Plan
    step_flops: int = 0
    forward_seconds: float | None = None
    pieces: int = 1
    budget: Budget | None = None
    depth: int | None = None

    def __post_init__(self) -> None:
        if self.depth is not None and self.depth < 1:
            raise ValueError(f"depth must be a positive number of path parts or None, got {self.depth}")

    def at_depth(self, depth: int | None) -> PlanReport:
        return replace(self, depth=depth)

    @property
    def rows(self) -> list[ModuleRow]:
        return self.plan.per_module(self.depth)

    @property
    def flop_overhead(self) -> float:
        """Recomputed FLOPs as a fraction of the step's forward+backward FLOPs."""
        return self.plan.recompute_flops / self.step_flops if self.step_flops else 0.0

    # --- shared pieces ----------------------------------------------------------------------

    def _status(self) -> str:
        gap = "n/a" if self.plan.gap is None else f"{self.plan.gap:.2%}"
        return f"Plan by {self.plan.solver} ({self.plan.status}, gap {gap}"

    def _budget(self) -> str:
        nbytes = "none" if self.plan.budget_bytes is None else format_bytes(self.plan.budget_bytes)
        return nbytes if self.budget is None else f"{self.budget} = {nbytes}"

    def _kept(self) -> str:
        plan = self.plan
        return f"{format_bytes(plan.kept_bytes)} of {format_bytes(plan.keep_all_bytes)}"

    # --- renderings -------------------------------------------------------------------------

    def headline(self) -> str:
        """One line: solver and status, budget, kept bytes, recompute cost."""
        plan = self.plan
        return (
            f"{self._status()}); budget {self._budget()}: kept {self._kept()} ({plan.kept_fraction:.1%}); "
            f"recompute ~{plan.recompute_seconds * 1e3:.3f} ms, {format_flops(plan.recompute_flops)} "
            f"(+{self.flop_overhead:.1%} of the step's {format_flops(self.step_flops)})"
        ) + "".join(f"; {note}" for note in plan.problem.notes)

    def text(self, limit: int = 200) -> str:
        """Plain text: totals, predicted memory, recompute overhead, then one row per module."""
        plan, problem = self.plan, self.plan.problem
        kind = "peak of the step" if plan.budget_kind == BudgetKind.PEAK else "saved for backward"
        lines = [
            f"{self._status()}, solved in {plan.solve_seconds:.2f}s) on {problem.device}",
            f"  budget           {self._budget()} ({kind})",
            f"  activations kept {self._kept()} without remat ({plan.kept_fraction:.1%})",
        ]
        if plan.predicted_peak_bytes is not None:
            lines.append(f"  predicted peak   {format_bytes(plan.predicted_peak_bytes)} of activation memory in the "
                         "step (activations, their gradients and recomputed temporaries; no weights or optimizer "
                         "state)")
        lines += [f"  note             {note}" for note in problem.notes]
        if plan.offloaded:
            lines.append(f"  offloaded        {format_bytes(plan.offloaded_bytes)} to host memory, "
                         f"{plan.exposed_transfer_seconds * 1e3:.3f} ms of transfer not hidden by compute")
        overhead = (f"  recompute        {plan.recompute_seconds * 1e3:.3f} ms ({problem.device}, {problem.costs}), "
                    f"{format_flops(plan.recompute_flops)}")
        if self.step_flops:
            overhead += f" = {self.flop_overhead:.2%} of the step's {format_flops(self.step_flops)}"
        lines.append(overhead)
        if self.forward_seconds:
            step = STEP_IN_FORWARDS * self.forward_seconds
            lines.append(f"                   ~{plan.recompute_seconds / step:.2%} of the step's time (estimated as "
                         f"{STEP_IN_FORWARDS}x the forward's {self.forward_seconds * 1e3:.3f} ms)")
        rows = self.rows
        depth = "innermost" if self.depth is None else f"depth {self.depth}"
        lines.append(f"  per module ({depth}): policy, kept / recomputed / keep-all bytes, recompute time")
        width = max((len(r.module or "(top level)") for r in rows), default=len("total"))

        def line(name: str, policy: str, kept: int, recomputed: int, keep_all: int, seconds: float) -> str:
            return (f"    {name:<{width}}  {policy:<9} {format_bytes(kept):>10} {format_bytes(recomputed):>10} "
                    f"{format_bytes(keep_all):>10} {seconds * 1e3:9.3f} ms")

        for row in rows[:limit]:
            lines.append(line(row.module or "(top level)", row.policy, row.kept_bytes, row.recomputed_bytes,
                              row.keep_all_bytes, row.recompute_seconds))
        if len(rows) > limit:
            lines.append(f"    ... {len(rows) - limit} more")
        lines.append(line("total", "", plan.kept_bytes, sum(r.recomputed_bytes for r in rows), plan.keep_all_bytes,
                          plan.recompute_seconds))
        return "\n".join(lines)

    def render(self, depth: int | None = None, limit: int = 200) -> str:
        """``text(limit)`` at ``depth`` (default: this report's depth)."""
        return (self if depth is None else self.at_depth(depth)).text(limit)

    def table(self) -> Table:
        """The per-module rows and their totals as a ``rich`` table."""
        from rich.table import Table

        table = Table(caption=POLICY_CAPTION, caption_justify="left")
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

    def show(self, console: Console | None = None) -> None:
        """Print the headline and the table (to the terminal unless ``console`` says otherwise)."""
        from rich.console import Console

        (console or Console()).print(self)

    def __str__(self) -> str:
        return self.text()

    def rich_text(self, width: int = 120) -> str:
        """What ``show`` prints, as plain text (no colours)."""
        from rich.console import Console

        buffer = io.StringIO()
        self.show(Console(file=buffer, width=width, no_color=True, highlight=False))
        return buffer.getvalue().rstrip("\n")

    def to_dict(self) -> dict[str, Any]:
        """``plan.to_dict(depth)`` plus the budget as asked, the step's FLOPs and the overhead ratio."""
        data = {
            **self.plan.to_dict(self.depth),
            "step_flops": self.step_flops,
            "flop_overhead": self.flop_overhead,
            "pieces": self.pieces,
        }
        if self.budget is not None:
            data["budget"] = {"fraction": self.budget.fraction, "bytes": self.budget.nbytes}
        if self.forward_seconds is not None:
            data["forward_seconds"] = self.forward_seconds
        return data


def memory_timeline(plan: Plan) -> dict[str, list[tuple[int, int]]]:
    """Live activation bytes over the step, un-rematerialized against ``plan``, for plotting.

    The series come from the plan-level model (``solvers.simulate_plan``), which the tests check
    against the graph-level replay (``remat_pass.rewrite.simulate``) and the CPU allocator
    (``remat_pass.runtime.measure``); it needs no graphs, so it works for merged multi-graph steps too.

    >>> # from remat_pass.tools.plots import plot_memory_timeline
    >>> # plot_memory_timeline(memory_timeline(plan), "memory.png")
    """
    from remat_pass import solvers

    problem = plan.problem
    series = {}
    for name, chosen in (("keep all (no remat)", solvers.solve(problem, solver="keep_all")),
                         (f"plan ({plan.solver})", plan)):
        memory = solvers.simulate_plan(problem, chosen)
        series[name] = list(enumerate([*memory.forward_live, *memory.backward_live]))
    return series


def report(plan: Plan, *, depth: int | None = None, step_flops: int | None = None,
           forward_seconds: float | None = None, limit: int = 200) -> str:
    """Plain-text account of a plan alone (``PlanReport.text``); ``depth`` defaults to the blocks'."""
    depth = depth if depth is not None else block_depth(plan.problem)
    return PlanReport(plan, step_flops or 0, forward_seconds, depth=depth).text(limit)


__all__ = ["PlanReport", "block_depth", "format_flops", "memory_timeline", "report"]
