"""Fit a peak budget to the program Inductor runs, by compiling candidate plans and measuring them.

The peak model the planners use (``solvers.analysis.memory``, checked by ``rewrite.simulate``)
is of the unfused program: every FX node a tensor, run in graph order (under Inductor but for the
backward tensors computed inside their readers' kernels, ``annotate.fused_costs``). Inductor runs another
program. It fuses pointwise chains, so their intermediates never exist (the model is too high:
BERT and the GPT landed 3-15% under their budgets in benchmarks/VS_INDUCTOR.md), and it groups
work into multi-output kernels and schedules them in its own order, so several buffers the
eager program makes one at a time are alive together (the model is too low: in the backward of
HF Llama's SwiGLU MLP one fused kernel writes three (batch, seq, 4h) gradient buffers at once,
and the step peaked 18-22% over its budget). Neither error has one sign or one size.

So the compiled step's peak is measured, never guessed: each candidate plan is compiled by
Inductor (the very compile the step will run) and run once on the inputs Dynamo compiled it for,
under the allocator (``measure.allocator_peak``: activations and temporaries, the parameter
gradients left out, as the benchmarks count them). The planner's budget is then moved by the
measured error, ``next = asked + (target - measured)``, and planned again, until the measured
peak lands within ``TOLERANCE`` under the budget or ``ATTEMPTS`` compiles are spent; the
cheapest candidate measured within the budget is the one that runs. None within it is a
``BudgetInfeasibleError`` naming the lowest measured peak: a budget is a promise.

What is predicted and what is measured: the plan (what to keep, what to recompute) comes from
the unfused model; whether it fits comes from the measurement, of the program that runs, on the
real inputs. The running step is Inductor's compile of the chosen plan, bit for bit the one measured
(no second compile). The measuring run leaves no trace: the inputs' values (buffers a step
updates) and the random-number state are restored, and the gradients are taken with
``torch.autograd.grad``, so nothing accumulates into ``.grad``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils._pytree import tree_leaves

from remat_pass import solvers
from remat_pass.solvers.problem import STEP_IN_FORWARDS, Plan

from ..compat import concrete_int
from .measure import allocator_peak

logger = logging.getLogger(__name__)

ATTEMPTS = 6
"""Compiles one graph may take to fit its budget (each is a full Inductor compile: seconds to a
minute on a CPU; the fitting is paid once per graph, at the first call)."""

TOLERANCE = 0.03
"""A measured peak within this fraction under the budget is close enough: no more re-planning."""

MIN_GAIN = 0.005
"""Another candidate is compiled only while, by the planner's own prices, it could still save this
fraction of the step's predicted time (``STEP_IN_FORWARDS`` forwards, as ``explain`` estimates a step). Below it the
prices' own error is larger than the gain, and each compile costs seconds to a minute: the 12-layer
HF GPT-2's fit at Hugging Face checkpointing's peak compiled five candidates at 15-35 s each, the
fourth to save a predicted 0.23% of the step over the third, the fifth measured over the budget
(benchmarks/VS_INDUCTOR.md, "Fewer compiles")."""


class SamePlan(Exception):
    """Raised by the planning side when a re-plan gives a plan already measured (nothing to
    compile); ``identity`` is that plan's ``plan_identity``."""

    def __init__(self, identity: tuple[frozenset[int], ...] | None = None) -> None:
        super().__init__("the plan made at this budget was measured already")
        self.identity = identity


@dataclass(frozen=True)
class Candidate:
    """One compiled plan and its measured peak; ``asked`` is the peak budget the planner was given."""

    asked: int
    plan: Plan
    measured_bytes: int
    compiled: Callable[..., Any] = field(repr=False, compare=False)


@dataclass(frozen=True)
class FitOutcome:
    """Where a fit ended, stored so that a restarted job starts there (``refit``): the user's peak
    budget, the budget the chosen plan was asked at (None: the user's own), and its measured peak."""

    target: int
    asked: int | None
    measured_bytes: int


def plan_identity(plan: Plan) -> tuple[frozenset[int], ...]:
    """What makes two plans the same program: what they keep, recompute, offload and refresh."""
    return plan.kept, plan.recomputed, plan.offloaded, plan.refreshed


@contextlib.contextmanager
def _no_trace(inputs: Sequence[Any]) -> Iterator[None]:
    """Restore every input that is neither a parameter nor needs a gradient (buffers a step updates in
    place, token ids) and the random-number state of the inputs' devices after the block. Frozen
    parameters are not copied (a fine-tuned model's frozen weights would be copied whole)."""
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    saved = [(x, x.detach().clone()) for x in tensors if not x.requires_grad and not isinstance(x, torch.nn.Parameter)]
    devices = sorted({x.device.index or 0 for x in tensors if x.is_cuda})
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            for tensor, value in saved:
                tensor.copy_(value)


def _device(inputs: Sequence[Any]) -> torch.device:
    devices = [x.device for x in inputs if isinstance(x, torch.Tensor) and x.device.type != "meta"]
    return next((d for d in devices if d.type != "cpu"), torch.device("cpu"))


def measure_step_peak(compiled: Callable[..., Any], inputs: Sequence[Any]) -> int | None:
    """The activation peak of one forward and backward of ``compiled`` on ``inputs`` (allocator
    bytes above what was live before, the input gradients it returns left out); None when no
    output needs a gradient (nothing to fit). A graph compiled for dynamic shapes is given its sizes
    as ``SymInt`` example inputs: it runs at their hints, the sizes Dynamo compiled it for (a
    ``SymInt`` passed as it is reads as garbage: a negative size)."""
    inputs = [concrete_int(x) if isinstance(x, torch.SymInt) else x for x in inputs]
    wants = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    gradients: list[torch.Tensor] = []
    found_backward = []

    def step() -> None:
        with torch.enable_grad():
            outputs = [y for y in tree_leaves(compiled(*inputs)) if isinstance(y, torch.Tensor) and y.requires_grad]
            if not outputs or not wants:
                return
            found_backward.append(True)
            seeds = [torch.ones_like(y) for y in outputs]
            found = torch.autograd.grad(outputs, wants, grad_outputs=seeds, allow_unused=True)
        gradients.extend(g for g in found if g is not None)

    with _no_trace(inputs):
        peak = allocator_peak(step, _device(inputs), lambda: gradients).peak_excluding
    return peak if found_backward else None


CompileAt = Callable[[int | None, set[tuple[frozenset[int], ...]]], tuple[Callable[..., Any], Plan]]
"""Compile the step with plans made at this peak budget (None: the user's own); raises ``SamePlan``
when the plan made is one of the given identities."""


def fit_peak(compile_at: CompileAt, inputs: Sequence[Any], *, attempts: int = ATTEMPTS,
             tolerance: float = TOLERANCE, min_gain: float = MIN_GAIN, clamp: bool = False,
             measure: Callable[[Callable[..., Any], Sequence[Any]], int | None] = measure_step_peak,
             first_refusal_ends: bool = False) -> Candidate:
    """Compile and measure until a plan's compiled step peaks within ``tolerance`` under its budget;
    the cheapest candidate within the budget (least predicted recompute time, then the highest
    peak). If none fits: ``BudgetInfeasibleError`` (the lowest measured peak as its minimum), or
    with ``clamp`` the lowest-peaked candidate and a warning. ``measure`` is ``measure_step_peak``
    (tests give a model of a compiler instead).

    The next budget asked is the last one moved by the measured error (a secant step with slope
    1), kept inside the bracket the attempts so far proved: above the highest the planner refused
    or whose plan fitted, below the lowest whose plan measured over; outside it, the bracket's
    middle. The planner's own lowest peak (a refusal's ``min_bytes``) is a search result, not a
    bound, so a refusal only moves the bracket's floor. A budget whose plan is one already
    measured (``SamePlan``: the unfused model predicts a plan that measured over the budget to fit
    under the lower one too) moves the bracket as that measurement did, its ceiling to that plan's
    predicted peak at most, and the search goes on: such an answer compiles nothing, so it is not
    counted in ``attempts`` (compiles and refusals), but at most ``2 * attempts`` answers are taken.
    The search also stops once no candidate left in the bracket could save ``min_gain`` of the
    step's predicted time over the cheapest one within the budget (``_gain_left``). With
    ``first_refusal_ends``, a refusal of the first budget (the user's) ends it: the backend's last
    try, whose first plan the planner searched for at length, so its refusal is the answer."""
    candidates: list[Candidate] = []
    seen: set[tuple[frozenset[int], ...]] = set()
    bracket = _Bracket()
    asked: int | None = None
    target: int | None = None
    refusal: solvers.BudgetInfeasibleError | None = None
    spent = 0  # compiles and refusals
    for _ in range(2 * attempts):
        if spent >= attempts:
            break
        spent += 1
        try:
            compiled, plan = compile_at(asked, seen)
        except SamePlan as same:
            spent -= 1
            logger.info("peak budget %s: the plan made at %s bytes was measured already; nothing compiled", target, asked)
            asked = _after_same_plan(same, asked, candidates, target, bracket)
            if asked is None:
                break
            continue
        except solvers.BudgetInfeasibleError as error:
            if error.kind != "peak":
                raise
            # The unfused model cannot plan this low; the fused program of a plan above may fit.
            refusal, target = error, error.budget_bytes if target is None else target
            logger.info("peak budget %d: the planner refused %d bytes (its lowest simulated peak: %d)", target,
                        error.budget_bytes, error.min_bytes)
            bracket.floor = max(bracket.floor, error.budget_bytes)
            if asked is None and first_refusal_ends:
                break
            asked = bracket.inside(error.min_bytes if asked is None else None)
            if asked is None:
                break
            continue
        target = plan.budget_bytes if target is None else target
        measured = measure(compiled, inputs)
        if target is None or measured is None:
            return Candidate(asked or 0, plan, measured or 0, compiled)
        this = asked if asked is not None else target
        candidates.append(Candidate(this, plan, measured, compiled))
        seen.add(plan_identity(plan))
        logger.info("peak budget %d: plan asked for %d bytes (its model: %s) measures %d bytes compiled "
                    "by Inductor (%.3f of the budget)", target, this, plan.predicted_peak_bytes,
                    measured, measured / target)
        # A plan that recomputes nothing but what Inductor fuses for free (``Plan.fused``) is
        # keep-all for this program: more budget cannot make it cheaper.
        if target * (1 - tolerance) <= measured <= target or (measured <= target and plan.recomputed <= plan.fused):
            break
        if measured > target:
            bracket.ceiling = this if bracket.ceiling is None else min(bracket.ceiling, this)
        else:
            bracket.floor = max(bracket.floor, this)
        gain = _gain_left(candidates, target)
        if gain < min_gain:
            logger.info("peak budget %d: no further candidate is compiled: the most one could save is %.2f%% of the "
                        "step's predicted time", target, 100 * gain)
            break
        asked = bracket.inside(this + int(target * (1 - tolerance / 2)) - measured)
        if asked is None:
            break
    return _choose(candidates, target, refusal, clamp)


def refit(compile_at: CompileAt, inputs: Sequence[Any], outcome: FitOutcome,
          measure: Callable[[Callable[..., Any], Sequence[Any]], int | None] = measure_step_peak,
          answered_by_caches: Callable[[], bool] = lambda: False) -> Candidate | None:
    """The candidate an earlier fit chose, compiled again (in a restarted job, from Inductor's
    caches): the candidate if it measures within the budget, else None (fit from the start). A
    fit replayed from the caches would measure every candidate again (a 12-layer GPT-2: five
    steps, 20 s against torch.compile's 6.6 s). Where the compile was answered by Inductor's
    caches (``answered_by_caches``) the program is the one measured before, bit for bit, on inputs
    of the same shapes, so that measurement stands and no step runs; otherwise it is measured once."""
    try:
        compiled, plan = compile_at(outcome.asked, set())
    except (SamePlan, solvers.BudgetInfeasibleError):
        return None
    reused = answered_by_caches()
    measured = outcome.measured_bytes if reused else measure(compiled, inputs)
    if measured is None or measured > outcome.target:
        logger.info("the plan an earlier fit chose measures %s bytes against the budget of %d; fitting again",
                    measured, outcome.target)
        return None
    logger.info("peak budget %d: the plan an earlier fit chose (asked for %s bytes) %s %d bytes compiled by "
                "Inductor (%.3f of the budget)", outcome.target, outcome.asked,
                "was measured at" if reused else "measures", measured, measured / outcome.target)
    return Candidate(outcome.asked or outcome.target, _as_budgeted(plan, outcome.target), measured, compiled)


def _gain_left(candidates: Sequence[Candidate], target: int) -> float:
    """The most recompute time a further candidate could save over the cheapest one measured within
    ``target``, as a fraction of the step's predicted time (inf while none fits, or without prices).
    A further budget is asked below the lowest whose plan measured over (the bracket's ceiling),
    and a plan made with less budget recomputes at least as much, so none is cheaper than the plan
    asked at the ceiling (none measured over: than recomputing nothing)."""
    fitting = [c.plan.predicted_extra_seconds for c in candidates if c.measured_bytes <= target]
    step = STEP_IN_FORWARDS * candidates[0].plan.problem.forward_seconds() if candidates else 0.0
    if not fitting or step <= 0:
        return math.inf
    over = [c for c in candidates if c.measured_bytes > target]
    ceiling = min(over, key=lambda c: c.asked).plan.predicted_extra_seconds if over else 0.0
    return (min(fitting) - ceiling) / step


def _after_same_plan(same: SamePlan, asked: int | None, candidates: list[Candidate], target: int | None,
                     bracket: "_Bracket") -> int | None:
    """The next budget to ask after ``asked`` gave a plan measured before: the bracket moved as
    that plan's measurement moved it (over the target: ``asked``, or the plan's predicted peak if
    lower, is a ceiling; within: a floor);
    None to stop (nothing known of the plan, or no room left)."""
    before = next((c for c in candidates if plan_identity(c.plan) == same.identity), None)
    if before is None or asked is None or target is None:
        return None
    if before.measured_bytes > target:
        # Any budget above the plan's own predicted peak gets that plan again: ask below it.
        below = min(asked, before.plan.predicted_peak_bytes or asked)
        bracket.ceiling = below if bracket.ceiling is None else min(bracket.ceiling, below)
    else:
        bracket.floor = max(bracket.floor, asked)
    return bracket.inside(None)


@dataclass
class _Bracket:
    """The budgets worth asking: above ``floor`` (refused, or its plan fitted), below ``ceiling``
    (its plan measured over)."""

    floor: int = 0
    ceiling: int | None = None

    def inside(self, proposal: int | None) -> int | None:
        """``proposal`` if strictly inside, else the middle; None once the bracket is too narrow."""
        if self.ceiling is not None and self.ceiling - self.floor <= max(self.ceiling // 200, 1):
            return None
        if proposal is not None and proposal > self.floor and (self.ceiling is None or proposal < self.ceiling):
            return proposal
        if self.ceiling is None:
            return None if proposal is None else max(proposal, self.floor + 1)
        return (self.floor + self.ceiling) // 2


def _choose(candidates: list[Candidate], target: int | None,
            refusal: solvers.BudgetInfeasibleError | None, clamp: bool) -> Candidate:
    fitting = [c for c in candidates if target is not None and c.measured_bytes <= target]
    if fitting:
        best = min(fitting, key=lambda c: (c.plan.predicted_extra_seconds, -c.measured_bytes))
        return Candidate(best.asked, _as_budgeted(best.plan, target), best.measured_bytes, best.compiled)
    if not candidates:
        assert refusal is not None
        raise refusal
    best = min(candidates, key=lambda c: c.measured_bytes)
    lowest = best.measured_bytes
    if clamp:
        logger.warning("the peak budget (%s bytes) is infeasible for this graph compiled by Inductor; "
                       "on_infeasible='clamp': running the lowest-peaked plan measured, %d bytes", target, lowest)
        return best
    keep_all = refusal.keep_all_bytes if refusal is not None else candidates[0].plan.predicted_peak_bytes or lowest
    error = solvers.BudgetInfeasibleError(target or 0, lowest, keep_all, kind="peak",
                                          lowest_kept_bytes=best.plan.kept_bytes)
    error.args = (f"{error.args[0]} (Measured: {len(candidates)} candidate plans compiled by Inductor, each step run "
                  "once; the lowest is theirs. inner='eager' runs the unfused program, whose peak the planner "
                  "models exactly, and may fit where Inductor's fused one does not.)",)
    raise error from refusal


def _as_budgeted(plan: Plan, target: int | None) -> Plan:
    return plan if target is None else replace(plan, budget_bytes=target)


__all__ = ["ATTEMPTS", "MIN_GAIN", "TOLERANCE", "Candidate", "FitOutcome", "SamePlan", "fit_peak", "measure_step_peak",
           "plan_identity", "refit"]
