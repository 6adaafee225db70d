"""Where the peak planner's time goes: each search phase's span and each candidate plan's arrival, for the
problems of ``python -m benchmarks.planning_time --solver-limits`` at the default effort (issue 31; SCALING.md,
"The first call, planned in half the limit"). The planner's phases are wrapped from outside; nothing in the
library changes. A candidate line: seconds since the call, predicted recompute seconds, whether its simulated
peak fits (else its peak over the budget), the phase that made it, ``*`` where it is the best that fits so far.

    PYTHONPATH=. python benchmarks/results/planner_phases/phases.py            # every case (~4 min here)
    PYTHONPATH=. python benchmarks/results/planner_phases/phases.py 0 4        # cases by index
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Any, Callable

from benchmarks.planning_time import problems
from remat_pass import solvers
from remat_pass.planning.effort import FAST_TIME_LIMIT, effort_options
from remat_pass.solvers.peak import planner

PHASES = ("with_mirrored_rows", "over_saved_cap", "with_step_rows", "polish", "fit_cheaper", "exact_rounds")
began = 0.0
events: list[str] = []
stack: list[str] = []


class Recorded(list):
    """The search's candidate list, noting when each candidate arrives and which phase made it."""

    budget = 0
    best: float | None = None

    def _note(self, candidate: Any) -> None:
        cost, peak = candidate.plan.predicted_extra_seconds, candidate.memory.peak_bytes
        fits = peak <= Recorded.budget
        better = fits and (Recorded.best is None or cost < Recorded.best * (1 - 1e-9))
        Recorded.best = cost if better else Recorded.best
        where = stack[-1] if stack else "baselines"
        verdict = "fits" if fits else f"{peak / Recorded.budget:.3f} x budget"
        events.append(f"  {time.perf_counter() - began:5.2f} s  candidate {cost:.5g} s, {verdict}, {where}{' *' if better else ''}")

    def append(self, candidate: Any) -> None:
        self._note(candidate)
        super().append(candidate)

    def __iadd__(self, others: Any) -> "Recorded":
        others = list(others)
        for candidate in others:
            self._note(candidate)
        return super().__iadd__(others)


def _phase(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter() - began
        stack.append(name)
        try:
            return method(*args, **kwargs)
        finally:
            stack.pop()
            events.append(f"  {start:5.2f}-{time.perf_counter() - began:5.2f} s  phase {name}")
    return timed


def _instrument() -> None:
    init = planner._Search.__init__

    def recorded_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.candidates = Recorded()

    planner._Search.__init__ = recorded_init
    for name in PHASES:
        setattr(planner._Search, name, _phase(name, getattr(planner._Search, name)))
    planner.plans_from_cap = _phase("plans_from_cap", planner.plans_from_cap)
    planner.saved_bytes_floor = _phase("saved_bytes_floor", planner.saved_bytes_floor)


def main() -> None:
    global began
    _instrument()
    cases = problems()
    chosen = [int(a) for a in sys.argv[1:]] or range(len(cases))
    options = effort_options("ilp_peak", FAST_TIME_LIMIT, False)
    for index in chosen:
        label, problem, budget = cases[index]
        events.clear()
        Recorded.budget, Recorded.best = budget, None
        began = time.perf_counter()
        try:
            answer = f"{solvers.solve(problem, budget, solver='ilp_peak', **options).predicted_extra_seconds:.6g} s"
        except solvers.BudgetInfeasibleError:
            answer = "refused"
        print(f"[{index}] {label}: {answer} in {time.perf_counter() - began:.2f} s", flush=True)
        print("\n".join(events), flush=True)


if __name__ == "__main__":
    main()
