"""Peak-aware planning: the least recompute time whose simulated step peak fits the budget.

A bound on saved bytes does not bound the peak: recomputed chains are held until their last
use, so a plan that keeps less can peak higher (``solvers.analysis.memory``). Modelling the memory of
every step exactly (Checkmate) makes the ILP grow with the square of the graph. Here the ILP
gets rows the simulator justifies, and every plan is checked on the simulator:

1. ``rows``: one *valid* row per backward interval (what any plan that keeps or
   recomputes a value must have alive there) and one at the forward's end. With storages
   rounded down this is a relaxation: its bound is a proven lower bound on the recompute time
   of every plan whose simulated peak fits. The same rows rounded up (plus the transient inputs
   of recomputed values) give plans; where one overshoots, valid cuts explain the storages the
   rows missed (a chain recomputed early and held, a kept value a later recompute reads), else
   the rows ask for the overshoot as margin, and the ILP runs again. Where a model repeats a
   block three times or more, one solve of these rows with identical blocks tied comes first,
   before step 2 (``mirrored_blocks``: the rows of about three blocks, not L; on 12-layer models the
   best plans come from it; a tied plan a little over the budget is made to fit in step 6, or
   at once where the untied rows are out of reach: a second round with cuts did not move the
   12-layer Llama's). Untied conservative rows that the tied solve's time, scaled, says will not
   finish in time are skipped (``untied_seconds``). Since the rows share one variable per view's
   set of literals (``rows``) they run at 12 layers too (1.2-1.6 s a round on the scaling GPT).
2. The older search over saved-bytes caps (``cap_search``: secant, then a few rounds of rows at the offending
   step on the best cap that still overshoots) adds its plans. Its caps (one quick ILP each)
   run before the rest of step 1 until a quarter of the limit has passed, and it resumes after
   step 1: on deep models step 1's untied MIPs can take the whole limit and end with no plan.
3. The checkpointing baselines (``per_block``: torch.utils.checkpoint per block) are
   candidates too, so the answer is never worse than them under this peak model.
4. ``exact_rows``: where the relaxation's plans peak, rows that follow the just-in-time
   schedule exactly there; each round's bound is proven, so the bound only tightens, and when
   the relaxation's own optimum fits it is the optimum (``exact_share`` of the limit at most).
   Their MIPs go to CP-SAT (``solvers.mip.cpsat``) where OR-Tools is installed: HiGHS's bound
   stalls on them (weak LP relaxation), CP-SAT usually proves each round in seconds.
5. ``local_search``, unless the best plan is proven optimal by then: from the cheapest plan
   that fits, moves of the keep set the simulator judges (a quarter of the time limit at most).
   After the exact rows, not before: where they prove the optimum it is not needed (on the
   small models of ``benchmarks.peak_optimality`` that cut planning from 9-29 s to 3-18 s on
   the three they prove, with the same plans everywhere, h256 models included).
6. Plans that overshoot but are cheaper than the best that fits are made to fit
   (``fit_overshoot``): by giving up kept values alive at the peak, or by refreshing values (made
   again for each step that reads them). On deep models tied plans a little over the budget are
   made to fit here (the 12-layer Llama's best, one value refreshed), as are the cuts' plans.

The answer is the cheapest candidate whose simulated peak fits: "optimal" only when its cost
meets the proven bound, else "feasible" with the gap to it (None when no bound was proven). The
bound is the rows' (steps 1 and 4), which holds for plans that make each recomputed value once, or
where that does not prove the answer the higher of it and ``schedule_bound``'s, which holds for any
recompute schedule: a plan with refreshed values (step 6) is outside the rows' model, and on the
h64 Llama-style model at per-block's peak the any-schedule bound is the tighter (0.553 of its
recompute against 0.545).
"""

from __future__ import annotations

import logging

from .. import baselines, clock
from ..mip.solve import resolve_backend
from ..mip.keep_model import rounding_for, time_weights, weights_for
from ..mip.run_keep import solve_once
from .exact_rows import ExactRowPlaces, exact_backend_for
from .local_search import improve
from ..analysis.memory import PlanMemory, peak_step_alive, simulate_plan
from .mirrored_blocks import MirroredRows, mirrored_pairs, shadowed_steps
from .fit_overshoot import fit_cheaper
from .multiple_recompute import refresh_lowest
from .rows import PeakRows, cuts_at
from .cap_repair_rows import plans_from_cap
from .cap_search import Candidate, CapSearch, refusal
from .schedule_bound import any_schedule_bound_by, saved_bytes_floor
from ..problem import Plan, Problem
from ..registry import Decision, planner
from ..status import DEFAULT_TIME_LIMIT, BudgetKind, Status, relative_gap

logger = logging.getLogger(__name__)

DEFAULT_ROUNDS = 4
# Rounds of valid cuts (each one ILP solve) before the peak-row search gives up.
CUT_ROUNDS = 12
# The time limit is the whole planning time. Its last shares, after the searches: overshooting plans
# made to fit (``fit_overshoot``), then, when the rows' bound does not prove the answer, the any-schedule
# bound (``schedule_bound``: ~2-4 s on the 4-layer models; the call returns early otherwise).
FIT_SHARE = 0.1
ANY_SCHEDULE_SHARE = 0.1
# On deep models, the tied plans that overshoot are made to fit at once, for this share at most.
EARLY_FIT_SHARE = 0.2
# Share of the time limit the saved-bytes-cap search may use before the peak rows (with the ILP).
CAP_SHARE = 0.25
# Share of the time limit for the local search from the best plan that fits (``local_search``).
LOCAL_SHARE = 0.25
# prove=False: once the tied rows' plan fits, the untied rows and the resumed cap search are skipped, and
# the local search, the fitting of overshoots and the bound get this share each, not what the limit has
# left. On the 12-layer HF GPT-2 of the first call and eight other cases of ``benchmarks.planning_time
# --solver-limits``, nothing after the tied solve and the first caps improved the answer at 2 s.
SETTLED_SHARE = 0.1
# Share of the time limit the exact rows (``exact_rows``) may use, after the other searches.
EXACT_SHARE = 0.25
# Each exact round's solve gets at least this long (or a third of the share, if longer): its
# bound and plan improve slowly with time, while a new row often moves them at once.
EXACT_ROUND_SECONDS = 3.0
EXACT_ROUND_MIN = 0.5  # no round starts with less time than this left
# A round that raises the bound by less than this (relative) and finds no cheaper plan makes no
# progress; this many such rounds in a row end them (a new row often moves nothing until the
# relaxation's plan runs out of other places to peak: HF BERT's second round did not).
EXACT_PROGRESS = 0.01
EXACT_PATIENCE = 3
# prove=False: the untied step rows (relaxed, then conservative) only up to this many backward steps per
# second of the limit, as their builds are not interrupted (48-layer scaling GPT, 4054 steps: 20-30 s relaxed
# here). The tied rows always run: their model is about three blocks' (48 layers: 1.9 s for the whole call);
FAST_ROWS_STEPS_PER_SECOND, SAVED_FLOOR_SHARE = 300, 0.1  # the last tenth for ``saved_bytes_floor``
# A plan this close (relative) to the proven lower bound is called optimal.
PROVEN_GAP = 1e-6
# When nothing fits, the minimum a refusal states comes from plans every refusal of the problem finds
# again (``probe``, the same for every budget): the saved-bytes caps' plans and the baselines; the
# LOWEST_REFRESHED of them that peak lowest, refreshed as far as that lowers their peak (``refresh_lowest``,
# LOWEST_REFRESH_SECONDS each at most); then peak searches asked for BELOW_FRACTIONS of the lowest peak
# so far (BELOW_SECONDS each; the searches are not monotone in their target, so each is tried). The caps
# minimise recompute under saved bytes, not the peak: on a 2-layer HF Gemma-2 their lowest peak was 0.53
# of eager's, and a budget of 0.25 was refused with "pass 0.53 or more" where plans of 0.30 exist.
LOWEST_REFRESHED, LOWEST_REFRESH_SECONDS = 2, 5.0
BELOW_FRACTIONS, BELOW_SECONDS = (0.8, 0.6), 2.0


def _rank(candidate: Candidate) -> tuple[float, int, int]:
    """Cheapest first; within ``PROVEN_GAP``, a plan without refreshed values first: the peak
    rows' proof covers it, while a refreshed one is measured against the looser any-schedule bound."""
    cost = candidate.plan.predicted_extra_seconds
    cost = cost if candidate.plan.refreshed else cost * (1 - PROVEN_GAP)
    return cost, candidate.memory.peak_bytes, candidate.plan.kept_bytes


@planner("ilp_peak", description="the ILP with simulated peak rows: the budget bounds the step's activation peak",
         exact=False, bounds=BudgetKind.PEAK)
def solve_peak(
    problem: Problem,
    budget_bytes: int | None = None,
    *,
    time_limit: float = DEFAULT_TIME_LIMIT,
    backend: str = "auto",
    rounds: int = DEFAULT_ROUNDS,
    threads: int | None = None,
    cap_solver: str = "ilp",
    host_budget_bytes: int | None = None,
    exact_share: float = EXACT_SHARE,
    exact_backend: str = "auto",
    prove: bool = True,
    refusal_time_limit: float | None = None,
    probe_minimum: bool = True,
) -> Decision:
    """The least recompute time whose simulated activation peak is at most ``budget_bytes``.

    ``cap_solver`` solves each saved-bytes cap: "ilp" (exact), or "fast" for deep models (the
    Lagrangian min-cut solver of ``solvers.mincut``; the peak-row rounds are then skipped,
    since they extend the ILP's model), or "ilp_offload" (keep, recompute or offload; caps
    bound device bytes, ``host_budget_bytes`` the host's; no peak rows either). Plans are
    ranked by predicted extra time: recompute plus exposed transfer time.

    With ``cap_solver="ilp"``: the valid peak rows (a proven lower bound, then plans and cuts),
    the saved-bytes-cap search, exact rows where the relaxation's plans peak (a tighter bound;
    at most ``exact_share`` of the time limit; solved by ``exact_backend``: "auto" is CP-SAT
    where OR-Tools is installed, else ``backend``), and, unless that proved the optimum, the
    local search from the best plan that fits; the other cap solvers only run the cap search.
    The baselines are candidates throughout. Raises BudgetInfeasibleError (kind "peak") with
    the lowest peak found when nothing fits.

    The answer comes within ``time_limit`` when a plan fits: the searches share its first 80%,
    making overshooting plans fit (``FIT_SHARE``) and, unless the rows proved the answer, the
    any-schedule bound (``ANY_SCHEDULE_SHARE``) the rest (model builds and the simulator are not
    interrupted, so a deep model may run a little past it).
    When nothing fits, a fixed probe of the trade-off curve follows (``cap_search.PROBE_TIME_LIMIT`` per
    cap; then its lowest-peak plans refreshed and peak searches below them, ``_Search._probed``), so that
    the smallest budget the error states is one a plan was found for; with
    ``probe_minimum=False`` the error states the lowest peak of the plans the search tried instead
    (for a caller that only moves on to another budget: the Inductor fit's re-asked candidates,
    where the probe took 27 s of a 12-layer GPT-2's 190 s fit).
    ``prove=False`` skips the proof work (exact rows, any-schedule bound); the gap is then the
    relaxation's (not built above ``FAST_ROWS_STEPS_PER_SECOND``) or the saved-bytes one, the higher.
    Without proof work a tied plan that fits also ends the searches early (``SETTLED_SHARE``): the
    answer then comes in about half the limit.
    ``refusal_time_limit``: when no plan fits at ``time_limit``, the searches go on until this many
    seconds after the call before the budget is refused (tried caps remembered, the tied solve not
    repeated, the rest run again with the longer limit): a short default limit then answers fast
    where a plan is easy and still finds the hard ones (a 6-layer BERT at 0.85 of per-block's peak:
    refused at 2 s, planned at 5 s).
    """
    began = clock.now()
    ends = began + time_limit
    keep_all = baselines.keep_all(problem)
    keep_all_memory = simulate_plan(problem, keep_all)
    if budget_bytes is None or keep_all_memory.peak_bytes <= budget_bytes:
        return _finish(keep_all, keep_all_memory, Status.OPTIMAL, 0.0)
    if cap_solver not in ("ilp", "fast", "ilp_offload"):
        raise ValueError(f"cap_solver must be 'ilp', 'fast' or 'ilp_offload', got {cap_solver!r}")
    bound_share = ANY_SCHEDULE_SHARE if prove else SAVED_FLOOR_SHARE
    searches_end = ends - (FIT_SHARE + bound_share) * time_limit
    if not 0.0 <= exact_share <= 1.0:
        raise ValueError(f"exact_share must be a fraction of the time limit in [0, 1], got {exact_share!r}")
    search = _new_search(problem, budget_bytes, resolve_backend(backend), searches_end, threads, cap_solver,
                         host_budget_bytes, time_limit, keep_all_memory, _baseline_candidates(problem))
    search.exact_backend = exact_backend_for(exact_backend, search.backend) if prove else search.backend  # import: 1-3 s
    bound = search.run(keep_all_memory, began, time_limit, prove, rounds, exact_share, bound_share)
    fitting = [c for c in search.candidates if c.memory.peak_bytes <= budget_bytes]
    if not fitting and refusal_time_limit is not None and refusal_time_limit > time_limit:
        # A refusal costs the user more than a few seconds: search on, from where the searches stand.
        logger.info("ilp_peak: no plan fits the budget after %.1f s; searching up to %.1f s before refusing it",
                    clock.now() - began, refusal_time_limit)
        time_limit, ends = refusal_time_limit, began + refusal_time_limit
        search.deadline = ends - (FIT_SHARE + bound_share) * time_limit
        more = search.run(keep_all_memory, began, time_limit, prove, rounds, exact_share, bound_share)
        bound = max((b for b in (bound, more) if b is not None), default=None)
    fitting = [c for c in search.candidates if c.memory.peak_bytes <= budget_bytes]
    if not fitting and not probe_minimum:
        raise refusal(budget_bytes, search.candidates, keep_all_memory.peak_bytes)
    if not fitting:
        # The stated minimum must itself work when tried, so it comes from a fixed probe of
        # the trade-off curve that every failing search repeats, not from this budget's search.
        probes = search.probe()
        fitting = [c for c in probes if c.memory.peak_bytes <= budget_bytes]
        if not fitting:
            raise refusal(budget_bytes, probes, keep_all_memory.peak_bytes)
    best = min(fitting, key=_rank)
    bound = None if best.plan.refreshed else bound  # the rows hold each recomputed value across its reads
    gap = relative_gap(best.plan.predicted_extra_seconds, bound)
    if search.settled:  # the bound gets its share of the limit, not the time the searches left unused
        ends = min(ends, clock.now() + bound_share * time_limit)
    if (gap is None or gap > PROVEN_GAP) and cap_solver != "ilp_offload":  # they bound recompute only
        floor = any_schedule_bound_by(problem, budget_bytes, backend=search.exact_backend, deadline=ends,
                                      threads=threads) if prove else saved_bytes_floor(problem, budget_bytes, ends)
        bound = max((b for b in (bound, floor) if b is not None), default=None)
        gap = relative_gap(best.plan.predicted_extra_seconds, bound)
    if gap is not None and gap <= PROVEN_GAP:
        return _finish(best.plan, best.memory, Status.OPTIMAL, 0.0)
    return _finish(best.plan, best.memory, Status.FEASIBLE, gap)


class _Search(CapSearch):
    """Plans tried so far, and the two ways of finding more: the saved-bytes caps (``CapSearch``)
    and the peak rows (steps, tied, exact), then the local search and the fitting of overshoots."""

    def __init__(self, problem: Problem, budget: int, backend: str, deadline: float, threads: int | None,
                 cap_solver: str = "ilp") -> None:
        super().__init__(problem, budget, backend, deadline, threads, cap_solver)
        self.relaxed_plan: Plan | None = None  # the plan of the valid rows' relaxation
        self.exact_backend = backend  # solves the exact rows' MIPs (``exact_backend_for``)
        # About how long the untied conservative step rows take, build and solve (``with_mirrored_rows``).
        self.untied_seconds = 0.0
        self.mirrored_tried = False  # the tied solve is made once (``with_mirrored_rows``)
        self.tied_plan_fits = False  # whether the tied solve (or its plans made to fit) gave a plan that fits
        self.settled = False  # without proof work, a tied plan that fits ends the searches (``run``)
        self.keep_all_memory: PlanMemory | None = None  # keep-all's simulated memory, for the probe's searches

    def run(self, keep_all_memory: PlanMemory, began: float, time_limit: float, prove: bool, rounds: int,
            exact_share: float, bound_share: float) -> float | None:
        """The searches of ``solve_peak`` until ``began + time_limit`` less ``bound_share`` of it;
        returns the rows' proven bound (None when none was proven). Run again with a longer limit,
        tried caps are answered from memory and the tied solve is not repeated; the rest runs again."""
        problem, cap_solver, bound = self.problem, self.cap_solver, None
        ends = began + time_limit
        # Identical blocks tied first (a model the size of about three blocks, quick at any depth: the
        # best plans of 12- and 48-layer models), then the saved-bytes caps (quick ILPs): plans near the
        # budget before the untied peak-row MIPs, which on deep models can take the limit.
        rows = prove or len(problem.backward_steps) <= FAST_ROWS_STEPS_PER_SECOND * time_limit
        if cap_solver == "ilp" and not self.mirrored_tried:
            self.with_mirrored_rows(time_limit)
        self.over_saved_cap(keep_all_memory, until=began + CAP_SHARE * time_limit if cap_solver == "ilp" else None)
        self.settled = not prove and self.tied_plan_fits
        if self.settled:
            logger.info("ilp_peak: the tied rows' plan fits; without proof work the other searches are skipped")
        if cap_solver == "ilp" and not self.settled:
            if rows:  # without the exact rows, its relaxation is the only proof: more time for it
                bound = self.with_step_rows(CUT_ROUNDS, share=1 / 3 if prove else 1 / 2)
            if self._left() > 0.1:  # the cap search resumed with what is left (tried caps are remembered)
                self.over_saved_cap(keep_all_memory)
            if self.overshooting_cap is not None and self._left() > 0.1:
                self.candidates += [Candidate(*found) for found in plans_from_cap(
                    problem, self.budget, self.overshooting_cap, rounds, self.deadline, backend=self.backend,
                    threads=self.threads)]
        if self.relaxed_plan is not None and prove:
            bound = self.exact_rounds(self.relaxed_plan, bound, min(self._left(), exact_share * time_limit))
        if cap_solver == "ilp" and not self.proven_by(bound):  # the simulator's own local search
            self.polish(min(self._left(), (SETTLED_SHARE if self.settled else LOCAL_SHARE) * time_limit))
        fit_until = ends - bound_share * time_limit
        if self.settled:
            fit_until = min(fit_until, clock.now() + SETTLED_SHARE * time_limit)
        # A plan that gives up kept values stays inside the peak model: none beats a proven optimum.
        self.fit_cheaper(self.candidates, fit_until, repair_kept=not self.proven_by(bound))
        return bound

    def with_step_rows(self, rounds: int, share: float = 1 / 3) -> float | None:
        """Plans from the ILP with a valid peak row per backward interval (``rows``).

        First the relaxation (storages rounded down, exact seconds as the objective): its bound
        is a proven lower bound on the recompute seconds of any plan that fits, returned. Then
        the same rows rounded up, tightened after each round by what the simulated plan still
        overshoots. Every plan becomes a candidate. None when no bound was proven.
        """
        problem, rounding = self.problem, rounding_for(self.problem)
        seconds, unit = time_weights(problem)
        relaxed = rounding.optimistic()
        outcome = solve_once(problem, None, rounding=relaxed, weights=seconds, time_limit=max(self._left() * share, 0.1),
                             backend=self.backend, threads=self.threads,
                             extension=PeakRows(problem, self.budget, relaxed), isolate=True)
        if outcome.status == "infeasible":
            return None
        bound = outcome.bound * unit if outcome.bound is not None else None
        if outcome.plan is not None:
            self.relaxed_plan = self._add(outcome.plan).plan
        self._rounds(rounds, self._left() / 2)  # the cap search and its rounds get the rest
        return bound

    def with_mirrored_rows(self, time_limit: float) -> None:
        """One plan of the conservative step rows with identical blocks tied (``mirrored_blocks``), the
        shadowed copies' rows left out, in half of what is left at most: on deep models its plans
        are the best (12-layer models: 2-5 s in round 11; a 48-layer GPT: a plan 2.8 s after the call).
        Where the untied conservative rows will not get the time they need (deep models), a tied
        plan a little over the budget is made to fit at once, not in the last window."""
        self.mirrored_tried = True
        pairs = mirrored_pairs(self.problem)
        if not pairs:
            return
        before, began = len(self.candidates), clock.now()
        shadowed = shadowed_steps(self.problem)
        self._rounds(1, self._left() / 2, pairs, shadowed)
        # The tied solve's time times the square of the rows it left out: a larger MIP that is also harder
        # (round 11, a 12-layer GPT-2: 2.4 s tied, no plan in 24 s untied). The relaxation is not gated: its
        # bound is worth its time (48 layers: solved in 5.2 s since the rows share their view variables).
        steps = len(self.problem.backward_steps)
        self.untied_seconds = (clock.now() - began) * (steps / max(steps - len(shadowed), 1)) ** 2
        if self.untied_seconds >= self._left() / 2:  # the tied plans, and those that fit
            among = [c for i, c in enumerate(self.candidates) if i >= before or c.memory.peak_bytes <= self.budget]
            self.fit_cheaper(among, min(clock.now() + EARLY_FIT_SHARE * time_limit, self.deadline))
        self.tied_plan_fits = any(c.memory.peak_bytes <= self.budget for c in self.candidates[before:])

    def exact_rounds(self, plan: Plan, bound: float | None, seconds: float) -> float | None:
        """Tighten the relaxation where its plan peaks (``exact_rows``) while that helps.

        Each round adds an exact row where the last plan overshot (the op of a backward step,
        the moment a value is made, or a forward value) and solves again: every round's bound
        is a proven lower bound (the best is returned) and every plan a candidate. When the
        relaxation's own optimum fits, it is the optimum. The MIP with these rows closes its gap
        slowly on HiGHS (CP-SAT, the default where installed, usually proves each round), so
        rounds stop after ``EXACT_PATIENCE`` in a row neither raise the bound by
        ``EXACT_PROGRESS`` nor find a cheaper plan that fits.
        """
        problem, relaxed = self.problem, rounding_for(self.problem).optimistic()
        weights, unit = time_weights(problem)
        deadline, rows = clock.now() + seconds, ExactRowPlaces(problem)
        per_round, idle = max(EXACT_ROUND_SECONDS, seconds), 0
        logger.debug("ilp_peak: exact rows get %.1f s (bound %s)", seconds, bound)
        while clock.now() < deadline - EXACT_ROUND_MIN:
            if self.proven_by(bound):
                break  # proven optimal already
            best = self._best_fitting()
            memory = simulate_plan(problem, plan)
            if memory.peak_bytes <= self.budget:
                break  # the relaxation's optimum fits: optimal (when the MIP was solved), or no row to add
            if not rows.add_where(plan, memory, self.budget):
                break  # every place it overshoots has a row: what they miss (a second tensor) stays
            outcome = solve_once(problem, None, rounding=relaxed, weights=weights, backend=self.exact_backend,
                                 time_limit=max(min(deadline - clock.now(), per_round), 0.1),
                                 threads=self.threads, extension=rows.extension(self.budget, relaxed))
            raised = outcome.bound is not None and outcome.bound * unit > (bound or 0.0) * (1 + EXACT_PROGRESS)
            if outcome.bound is not None:
                bound = max(bound or 0.0, outcome.bound * unit)
            if outcome.plan is None:
                logger.debug("ilp_peak: exact rows: %s, no plan", outcome.status)
                break
            candidate = self._add(outcome.plan)
            plan = candidate.plan
            logger.debug("ilp_peak: exact rows at steps %s, events %s (%s): %.4g s, peak %d (budget %d), bound %s",
                         rows.steps, rows.events, outcome.status, plan.predicted_extra_seconds,
                         candidate.memory.peak_bytes, self.budget, bound)
            cheaper = candidate.memory.peak_bytes <= self.budget and (
                best is None or plan.predicted_extra_seconds < best * (1 - PROVEN_GAP))
            idle = 0 if raised or cheaper else idle + 1
            if idle >= EXACT_PATIENCE:
                break
        return bound

    def polish(self, seconds: float) -> None:
        """Improve the cheapest plan that fits by moves the simulator judges (``local_search``)."""
        fitting = [c for c in self.candidates if c.memory.peak_bytes <= self.budget and not c.plan.refreshed
                   and not c.plan.offloaded]
        if not fitting or seconds <= 0:
            return
        start = min(fitting, key=lambda c: c.plan.predicted_extra_seconds).plan
        better = improve(self.problem, start, self.budget, clock.now() + seconds)
        if better is not start:
            logger.debug("ilp_peak: local search %.4g s -> %.4g s", start.predicted_extra_seconds,
                         better.predicted_extra_seconds)
            self._add(better)

    def proven_by(self, bound: float | None) -> bool:
        """Whether the best plan that fits meets ``bound`` (it is then optimal)."""
        best = self._best_fitting()
        return best is not None and bound is not None and best <= bound * (1 + PROVEN_GAP)

    def _best_fitting(self) -> float | None:
        """The least predicted extra time of a candidate that fits, None when none does."""
        return min((c.plan.predicted_extra_seconds for c in self.candidates if c.memory.peak_bytes <= self.budget),
                   default=None)

    def _rounds(self, rounds: int, reserve: float, pairs: tuple[tuple[int, int], ...] = (),
                shadowed: frozenset[int] = frozenset()) -> None:
        """ILP plans under the conservative peak rows, tightened by cuts or a margin while they
        overshoot; with ``pairs``, identical blocks make the same choices (``mirrored_blocks``) and the
        rows of the ``shadowed`` steps are left out."""
        problem, rounding = self.problem, rounding_for(self.problem)
        margin, cuts = 0, set()
        weights = weights_for(problem)
        for round_index in range(rounds):
            if self._left() <= max(reserve, 0.1) or (not pairs and self._left() - reserve < self.untied_seconds):
                break  # with less time than the untied rows take, no plan (round 11: 12 layers)
            rows = PeakRows(problem, self.budget, rounding, margin, tuple(sorted(
                cuts, key=lambda c: (c.step, c.storage, c.literals))), transients=True, kept_readers=True)
            outcome = solve_once(problem, None, rounding=rounding, weights=weights,
                                 time_limit=max(self._left() - reserve, 0.1), backend=self.backend, threads=self.threads,
                                 extension=MirroredRows(rows, pairs, shadowed) if pairs else rows, isolate=True)
            if outcome.plan is None:
                logger.debug("ilp_peak: step rows: %s, no plan", outcome.status)
                break
            candidate = self._add(outcome.plan)
            logger.debug("ilp_peak: step rows%s, margin %d, %d cuts: %.4g s, kept %d, peak %d (budget %d)",
                         " (mirrored)" if pairs else "", margin, len(cuts), outcome.plan.predicted_extra_seconds,
                         outcome.plan.kept_bytes, candidate.memory.peak_bytes, self.budget)
            if candidate.memory.peak_bytes <= self.budget:
                break
            step, alive, _ = peak_step_alive(problem, outcome.plan, candidate.memory)
            new = set(cuts_at(problem, outcome.plan, step, alive)) - cuts if step is not None else set()
            if new:
                cuts |= new
            else:  # nothing valid explains the excess: ask the rows for that much more room
                margin += candidate.memory.peak_bytes - self.budget

    def _probed(self, fractions: tuple[float, ...]) -> list[Candidate]:
        """The probe's caps and baselines (``CapSearch``), the lowest-peak ones refreshed, and the peak
        search's plans below them: plans that depend on the problem only, not on the budget refused,
        so a refusal of any budget finds them again and the minimum stated is one a plan was found for."""
        probed = super()._probed(fractions)
        if not probed:
            return probed
        lowest = sorted(probed, key=lambda c: c.memory.peak_bytes)[:LOWEST_REFRESHED]
        refreshed = [Candidate(*refresh_lowest(self.problem, c.plan, clock.now() + LOWEST_REFRESH_SECONDS, c.memory))
                     for c in lowest if not c.plan.offloaded]
        found = probed + [c for c in refreshed if c.plan.refreshed]
        lowest_peak = min(c.memory.peak_bytes for c in found)
        baseline_candidates = _baseline_candidates(self.problem)
        for fraction in BELOW_FRACTIONS:
            below = self._lowest_searched(int(lowest_peak * fraction), baseline_candidates)
            if below is not None and below.memory.peak_bytes < lowest_peak:
                found.append(below)
                lowest_peak = below.memory.peak_bytes
        logger.info("ilp_peak: the probe's lowest peak: %d bytes for the caps and baselines, %d bytes in all",
                    lowest[0].memory.peak_bytes, lowest_peak)
        return found

    def _lowest_searched(self, target: int, baseline_candidates: list[Candidate]) -> Candidate | None:
        """The lowest-peak plan of the peak search asked for ``target`` bytes (``BELOW_SECONDS``)."""
        began = clock.now()
        search = _new_search(self.problem, target, self.backend, began + (1 - FIT_SHARE - SAVED_FLOOR_SHARE) * BELOW_SECONDS,
                             self.threads, self.cap_solver, self.host_budget_bytes, BELOW_SECONDS, self.keep_all_memory,
                             baseline_candidates)
        search.run(self.keep_all_memory, began, BELOW_SECONDS, False, DEFAULT_ROUNDS, 0.0, SAVED_FLOOR_SHARE)
        return min(search.candidates, key=lambda c: (c.memory.peak_bytes, _rank(c)), default=None)

    def fit_cheaper(self, among: list[Candidate], deadline: float, repair_kept: bool = True) -> None:
        """Plans of ``among`` that overshoot but are cheaper than its best that fits, made to fit
        (``solvers.peak.fit_overshoot``), become candidates."""
        plans = [(c.plan, c.memory) for c in among]
        self.candidates += [Candidate(*found) for found in fit_cheaper(self.problem, plans, self.budget, deadline,
                                                                         repair_kept)]

    def _add(self, plan: Plan) -> Candidate:
        candidate = Candidate(plan, simulate_plan(self.problem, plan))
        self.candidates.append(candidate)
        return candidate


def _new_search(problem: Problem, budget: int, backend: str, deadline: float, threads: int | None, cap_solver: str,
                host_budget_bytes: int | None, time_limit: float, keep_all_memory: PlanMemory,
                baseline_candidates: list[Candidate]) -> _Search:
    """A search for ``budget`` until ``deadline``, the baselines its first candidates (the local search
    starts from one that fits)."""
    search = _Search(problem, budget, backend, deadline, threads, cap_solver)
    search.host_budget_bytes, search.keep_all_memory = host_budget_bytes, keep_all_memory
    if cap_solver == "ilp_offload":  # its MIP rarely closes its gap: give each cap a share, not all
        search.cap_seconds = time_limit / 8
    search.candidates += baseline_candidates
    return search


def _baseline_candidates(problem: Problem) -> list[Candidate]:
    return [Candidate(p, simulate_plan(problem, p)) for p in baselines.heuristic_plans(problem)]


def _finish(plan: Plan, memory: PlanMemory, status: Status, gap: float | None) -> Decision:
    return Decision.of(plan, status, gap, source=plan.solver, predicted_peak_bytes=memory.peak_bytes)
