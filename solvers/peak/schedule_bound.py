"""A lower bound on the recompute time of *any* schedule that fits a peak budget.

The peak planner's own bound (``rows``, ``exact_rows``) is proven for its model: every
recomputed value made once, just in time, and held until its last backward use. A plan with
refreshed values (``solvers.peak.multiple_recompute``: made again for each step that reads it) is outside that
model and may be cheaper than its optimum, so that bound says nothing about it. This one holds
for every schedule that runs the backward steps in their order, whatever it recomputes, when,
and how many times, so it bounds refreshed plans too, and it measures how much any form of
multiple recomputation could still gain over the planner's model.

It is a time-indexed relaxation in the spirit of Checkmate (Jain et al., MLSys 2020), at a
chosen set of backward steps ``T`` (any subset gives a valid bound; more steps, a tighter one):

* ``c_x``: value ``x`` is computed in backward at least once (costs its recompute time: the
  objective is a lower bound however many times it is made);
* ``h_s``: storage ``s`` is alive at the forward's end (``sum h_s bytes + outputs <= budget``);
* per step ``t`` in ``T``: ``z_xt`` (``x`` alive while ``t`` runs) and ``r_xt`` (``x`` made
  after ``t``). What ``t`` reads is alive; what a later step reads is alive or made after
  ``t``, and what is made after ``t`` has each input alive at ``t`` or made after it (backward
  ops make no forward values, so everything made later comes from what is alive now). An
  element of a multi-output op's result (a getitem of its tuple) is made later only by running
  the op later: the tuple has no bytes, and "alive" it would hold its elements for nothing. Alive
  and never computed in backward means held from the forward (``h``), so it was alive at every
  earlier step of ``T`` too. The storages alive plus the step's working bytes fit the budget.

Storages are rounded down and the budget up (the optimistic rounding), so rounding only
loosens it. Kernel scratch and the moments between steps are left out, which loosens it too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pulp

from .. import clock
from ..analysis.graph_facts import relevant_values
from ..mip.solve import add_row, binary, run_mip
from ..mip.keep_model import rounding_for
from ..analysis.lifetimes import backward_steps_of
from ..problem import Problem
from ..status import CLOSED_GAP

logger = logging.getLogger(__name__)

# Backward steps with rows by default: the ones whose fixed memory (working bytes, what they read,
# the outputs) is highest. On the built-in GPT-style model (4 layers h64, 349 steps; CP-SAT) 8 and 30
# steps bound 0.667 of per-block checkpointing's recompute at its peak (0.7 s, 1.2 s), 48 and all 349
# steps 0.688 (1.6 s, 18 s), the planner's optimum (one recomputation per value) being 0.708
# (``python -m benchmarks.peak_optimality --model gpt --schedule-steps N`` gives the bound at N steps).
DEFAULT_STEPS = 48
# The peak planner's answer's bound (``any_schedule_bound_by``) is not tried with less than this left,
# nor with less than this per value: its quick model (below) takes ~2 ms a value to build and solve (the
# scaling GPT at per-block's peak, CP-SAT: 2.1 s at 12 layers, 4.2 s at 24, 8.6 s at 48), and CP-SAT has a
# bound to give at its limit after about half of that. A try that cannot finish would only overrun the limit.
ANSWER_BOUND_MIN_SECONDS = 1.0
ANSWER_BOUND_SECONDS_PER_VALUE = 1e-3
# ... and its first model has rows at this few steps, then, with time left, at ``DEFAULT_STEPS``: on
# the 12-layer Llama of the benchmarks (CP-SAT, 6 s) 8 steps bound 0.0667 s in 2.8 s, 48 steps
# nothing in 6 s (0.0667 s in 10.8 s; ``benchmarks/RESULTS.md``, "Round 13").
QUICK_BOUND_STEPS = 8
# saved_bytes_floor polishes its bound with the fast planner's ILP only where the time left is this
# many times what the hull alone took (the polish's model build, not interruptible, is ~4x the hull).
FLOOR_POLISH_RATIO = 10
# Its hull pass gets at least this long, whatever is left: without it a short limit (2 s, the default)
# would answer without a gap, and quality may not drop silently (0.04 s at 12 layers, 0.07 s at 48).
FLOOR_HULL_SECONDS = 0.25


@dataclass(frozen=True)
class ScheduleBound:
    """A proven lower bound on the recompute seconds of any schedule that fits, and how it was had."""

    seconds: float | None  # None: the backend proved nothing in time
    steps: int  # backward steps with rows
    status: str  # the MIP's status: "optimal" means the relaxation itself was solved
    solve_seconds: float


def fixed_step_bytes(problem: Problem) -> list[int]:
    """Per backward step, the bytes every schedule has then: its working bytes, the storages it
    reads and the step's outputs (held to the end)."""
    values, sizes = problem.values, problem.storage_bytes
    outputs = {values[i].storage for i in problem.forward_outputs}
    held = sum(sizes[s] for s in outputs)
    found = []
    for step in backward_steps_of(problem):
        read = {values[v].storage for v in step.reads if not values[v].available} - outputs
        found.append(step.working_bytes + held + sum(sizes[s] for s in read))
    return found


def bound_steps(problem: Problem, count: int = DEFAULT_STEPS) -> list[int]:
    """The ``count`` backward steps with the most fixed bytes, in backward order."""
    fixed = fixed_step_bytes(problem)
    return sorted(sorted(range(len(fixed)), key=lambda t: (-fixed[t], t))[:count])


class _Relaxation:
    """The PuLP model of the module docstring, for one budget."""

    def __init__(self, problem: Problem, budget_bytes: int, steps: list[int], until: float = float("inf")) -> None:
        """The model's rows at ``steps``; ``complete`` is False when the build stopped at ``until``
        (a partial model bounds nothing that was asked)."""
        self.problem = problem
        self.complete = False
        values = problem.values
        rounding = rounding_for(problem)
        self.quantum = rounding.quantum
        self.outputs = {values[i].storage for i in problem.forward_outputs}
        self.lp = pulp.LpProblem("any_schedule_bound", pulp.LpMinimize)
        relevant = sorted(v for v in relevant_values(problem) if not values[v].available)
        self.compute = {x: binary(self.lp, f"c_{x}") for x in relevant if values[x].recomputable}
        self.held = {s: binary(self.lp, f"h_{s}") for s in sorted({values[x].storage for x in relevant})
                     if s not in self.outputs and problem.storage_bytes[s] > 0}
        pinned = sum(problem.storage_bytes[s] for s in self.outputs)
        self.lp += self._bytes(self.held) <= self._room(budget_bytes - pinned), "forward_end"
        working = {t: s.working_bytes for t, s in enumerate(backward_steps_of(problem))}
        later = self._read_after(set(steps))
        previous: dict[int, pulp.LpVariable] = {}
        for t in steps:
            if clock.now() > until:
                return
            previous = self._step(t, later[t], budget_bytes - pinned - working[t], previous)
        cost = {x: values[x].recompute_seconds for x in self.compute}
        self.unit = max(min((c for c in cost.values() if c > 0), default=1.0), sum(cost.values()) / 1e6) / 1e6
        self.lp += pulp.lpSum(c / self.unit * self.compute[x] for x, c in cost.items() if c > 0)
        self.complete = True

    def _room(self, free_bytes: int) -> int:
        return -(-free_bytes // self.quantum)  # the budget rounded up: a relaxation

    def _bytes(self, by_storage: dict[int, pulp.LpVariable]) -> pulp.LpAffineExpression:
        sizes = self.problem.storage_bytes
        return pulp.lpSum(sizes[s] // self.quantum * var for s, var in by_storage.items() if sizes[s] >= self.quantum)

    def _read_after(self, chosen: set[int]) -> dict[int, set[int]]:
        """Per chosen backward step, the forward values a later step reads (copied at those steps
        only: at every step, 4054 on a 48-layer GPT, the copies grow with steps times values)."""
        steps = backward_steps_of(self.problem)
        found: dict[int, set[int]] = {}
        later: set[int] = set()
        for t in range(len(steps) - 1, -1, -1):
            if t in chosen:
                found[t] = set(later)
            later |= {v for v in steps[t].reads if not self.problem.values[v].available}
        return found

    def _free(self, x: int) -> bool:
        """Present at every step of every schedule: had by the caller, or a step output's storage."""
        value = self.problem.values[x]
        return value.available or value.storage in self.outputs

    def _needed(self, t: int, later: set[int]) -> set[int]:
        """What step ``t`` reads, what a later step reads, and their ancestors: the values that
        may be alive at ``t`` or made after it to any purpose."""
        values, found = self.problem.values, set()
        stack = [v for v in (*backward_steps_of(self.problem)[t].reads, *later) if not self._free(v)]
        while stack:
            x = stack.pop()
            if x not in found:
                found.add(x)
                stack.extend(u for u in values[x].inputs if not self._free(u))
        return found

    def _input_sources(self, x: int, u: int, alive: dict[int, pulp.LpVariable],
                       made: dict[int, pulp.LpVariable]) -> list[pulp.LpVariable]:
        """What lets ``x`` be made after a step from its input ``u``: ``u`` alive then, or made after it.

        An element of a multi-output op's result (a getitem of its tuple) is made only by running
        the op again. The tuple has no bytes of its own, so counting it alive would let its elements
        be made later for nothing while their bytes are counted nowhere: that alone put the bound
        at 0.44 of per-block checkpointing's recompute on the h64 GPT-style model, 0.69 without it.
        """
        values = self.problem.values
        if values[x].op == "getitem" and not values[u].keepable and not values[u].available:
            return [made[u]] if u in made else []
        return [alive[u], made[u]] if u in made else [alive[u]]

    def _step(self, t: int, later: set[int], free_bytes: int,
              previous: dict[int, pulp.LpVariable]) -> dict[int, pulp.LpVariable]:
        problem, lp, values = self.problem, self.lp, self.problem.values
        needed = sorted(self._needed(t, later))
        alive = {x: binary(lp, f"z_{x}_{t}") for x in needed}
        made = {x: binary(lp, f"r_{x}_{t}") for x in needed if x in self.compute}
        storages: dict[int, pulp.LpVariable] = {}
        for x in needed:  # each row ``lhs <= rhs`` as ``lhs - rhs <= 0`` (``_at_most``)
            storage = values[x].storage
            source = [self.compute[x]] if x in self.compute else []
            if values[x].keepable and storage in self.held:
                source.append(self.held[storage])
            if problem.storage_bytes[storage] > 0:  # alive: computed in backward, or held from the forward
                _at_most(lp, alive[x], source)
                if storage not in storages:
                    storages[storage] = binary(lp, f"zs_{storage}_{t}")
                _at_most(lp, alive[x], [storages[storage]])
            if x in made:
                _at_most(lp, made[x], [self.compute[x]])
                for u in values[x].inputs:
                    if not self._free(u):  # an input of what is made later: alive now, or made later too
                        _at_most(lp, made[x], self._input_sources(x, u, alive, made))
            if x in previous:  # never computed in backward: alive since the forward
                _at_most(lp, alive[x], [previous[x], self.compute[x]] if x in self.compute else [previous[x]])
        for v in backward_steps_of(problem)[t].reads:
            if v in alive:
                add_row(lp, {alive[v]: 1}, pulp.LpConstraintEQ, 1)
        for v in later:
            if v in alive:
                add_row(lp, {alive[v]: 1, made[v]: 1} if v in made else {alive[v]: 1}, pulp.LpConstraintGE, 1)
        lp += self._bytes(storages) <= self._room(free_bytes), f"memory_{t}"
        return alive


def _at_most(lp: pulp.LpProblem, variable: pulp.LpVariable, sources: list[pulp.LpVariable]) -> None:
    """``variable <= sum(sources)``, built as one expression (``mip.solve.add_row``), auto-named as PuLP's ``+=``."""
    add_row(lp, {variable: 1, **{source: -1 for source in sources}}, pulp.LpConstraintLE, 0)


def any_schedule_bound(problem: Problem, budget_bytes: int, *, backend: str, time_limit: float,
                       threads: int | None = None, steps: int = DEFAULT_STEPS) -> ScheduleBound:
    """A lower bound on the recompute seconds of every schedule of ``problem`` whose peak is at
    most ``budget_bytes``, multiple recomputation included (rows at ``steps`` backward steps).
    ``seconds`` is None when the model is not built and solved to a bound in ``time_limit``; a
    relaxation with no solution proves that nothing fits, and its bound is then infinite."""
    ends = clock.now() + time_limit
    chosen = bound_steps(problem, steps)
    fixed = fixed_step_bytes(problem)
    if any(fixed[t] > budget_bytes for t in chosen):
        return ScheduleBound(float("inf"), len(chosen), "infeasible", 0.0)
    relaxation = _Relaxation(problem, budget_bytes, chosen, until=ends)
    if not relaxation.complete or ends - clock.now() < 0.1:
        logger.debug("any-schedule bound: out of time building its model (%.1f s)", time_limit)
        return ScheduleBound(None, len(chosen), "time_limit", 0.0)
    result = run_mip(relaxation.lp, backend=backend, time_limit=ends - clock.now(), threads=threads)
    if result.status == "infeasible":
        return ScheduleBound(float("inf"), len(chosen), "infeasible", result.seconds)
    seconds = None if result.bound is None else max(result.bound, 0.0) * relaxation.unit
    logger.debug("any-schedule bound: %s s (%s, %d steps, %.1f s)", seconds, result.status, len(chosen),
                 result.seconds)
    return ScheduleBound(seconds, len(chosen), result.status, result.seconds)


def any_schedule_bound_by(problem: Problem, budget_bytes: int, *, backend: str, deadline: float,
                          threads: int | None = None) -> float | None:
    """The best ``any_schedule_bound`` proven by ``deadline`` (the peak planner's time limit): rows at a
    few steps first (quick), then at the default steps (tighter). None when nothing was proven by then
    (an infinite bound, which a plan that fits contradicts, is logged and dropped).

    The peak planner asks for it when its rows' bound does not prove its answer: a refreshed answer is
    outside the rows' model, and elsewhere it can be the tighter of the two."""
    best: float | None = None
    least = max(ANSWER_BOUND_MIN_SECONDS, ANSWER_BOUND_SECONDS_PER_VALUE * len(problem.values))
    for steps in (QUICK_BOUND_STEPS, DEFAULT_STEPS):
        seconds = deadline - clock.now()
        if seconds < least:
            break
        found = any_schedule_bound(problem, budget_bytes, backend=backend, time_limit=seconds, threads=threads,
                                   steps=steps)
        if found.seconds is not None and found.seconds == float("inf"):
            logger.warning("ilp_peak: the any-schedule relaxation has no solution although a plan fits; no bound")
            return None
        if found.seconds is not None:
            best = max(best or 0.0, found.seconds)
    if best is None:
        logger.info("ilp_peak: no any-schedule bound proven in time")
    return best


def saved_bytes_floor(problem: Problem, budget_bytes: int, deadline: float) -> float | None:
    """A lower bound on the recompute of every plan whose simulated peak is at most ``budget_bytes``,
    refreshed ones too (None: none proven by ``deadline``): each kept storage is alive at the end of
    forward, so such a plan keeps at most ``budget_bytes``, and the fast planner's proven bound at
    that saved-bytes cap bounds them all (a value made again costs more than made once). Cheap where
    the any-schedule bound is not: 0.4 s on a 12-layer HF GPT-2 at checkpointing's peak, there the
    peak rows' relaxation's bound itself (0.561 s of recompute against the plan's 0.680 s).

    Only the bound is wanted, so the fast planner runs without its bucket refinement (which
    improves its plan, never its bound) and first without its ILP polish: the Lagrangian hull's
    bound alone (0.04 s at 12 layers, 0.07 s at 48), given ``FLOOR_HULL_SECONDS`` at least, past the
    deadline if need be, so that an answer has a gap. The polish, whose MIP can raise the bound a
    little (0.25% on the 12-layer HF GPT-2 below its checkpointing peak), runs only where the time
    left is ``FLOOR_POLISH_RATIO`` times the hull's: its model build is not interrupted, and at 48
    layers it ran 0.2 s past the planner's deadline for the same bound (benchmarks/SCALING.md)."""
    from ..errors import BudgetInfeasibleError, SolverError
    from ..fast import solve_fast

    began = clock.now()
    bound = None
    for polish in (False, True):
        seconds = deadline - clock.now()
        if polish and (seconds <= 0.1 or seconds < FLOOR_POLISH_RATIO * (clock.now() - began)):
            break
        seconds = max(seconds, FLOOR_HULL_SECONDS)
        try:
            plan = solve_fast(problem, budget_bytes, time_limit=seconds, polish=polish, refine=False)
        except (BudgetInfeasibleError, SolverError):
            return bound
        if plan.gap is not None:
            bound = max(bound or 0.0, plan.recompute_seconds * (1 - plan.gap))
        if plan.gap is not None and plan.gap <= CLOSED_GAP:
            break
    return bound