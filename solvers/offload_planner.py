"""Keep, recompute or offload: one decision per value, in one integer program.

The keep/recompute model (``solvers.mip.keep_model``) gets a third place for a saved storage: host
memory. Per offloadable storage ``s`` (``transfers.offload_candidates``) a binary ``h_s``; a
saved value's storage is paid on the device (``g_s``) or offloaded (``h_s``), never both; only
``g_s`` counts against the device budget, only ``h_s`` against the optional host budget.

Transfers cost time only where compute cannot hide them (``solvers.analysis.transfers`` states the
model). Both directions are single-machine queues, and both are linear:

* forward, sends released in creation order: the backlog after send ``k`` is
  ``W_k = max(0, W_{k-1} - gap_k) + p_k h_k`` (Lindley's recursion; ``gap_k`` the compute
  between two creations), relaxed to two rows a minimization makes tight; the exposed time is
  ``max(0, W_last - compute after the last creation)``. A send holds its device bytes until it
  is done, so the device budget also bounds, after each op that makes a saved storage, the
  storages kept so far plus the sends still pending when the op began (the backlog, in bytes):
  offloading frees device memory only as fast as the link drains it;
* backward, fetches all available at the start and served earliest deadline first: the
  exposed time is the largest lateness, ``max_k (sum_{j<=k} p_j h_j - d_k)``, with ``d_k`` the
  start of the first backward op that reads the storage. A value recomputed from an offloaded
  storage could need it earlier: a row forbids recomputing such readers of an offloaded
  storage (``Candidate.early_users``), so the deadline holds.

The objective is recompute time plus both exposed times, in the same units, plus a tie-break
that prefers the device over the host when the budget leaves room. The exposed time a plan
really has comes from ``transfers.transfer_schedule`` (``Plan.exposed_transfer_seconds``); the
model's is an upper bound of it, so "optimal" here is optimal for that bound.

For peak budgets the peak planner (``solvers.peak.planner``, ``cap_solver="ilp_offload"``) searches
the device-bytes cap with the memory simulator, which knows transfers, in the loop: sends still
in flight hold device memory, so offloading more does not always lower the forward's peak.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import pulp

from . import baselines, clock
from .mip.solve import MipResult, binary, resolve_backend
from .mip.keep_model import Model, rounding_for, weights_for
from .mip.run_keep import solve_once
from .errors import BudgetInfeasibleError, SolverError
from .ilp import min_feasible_bytes, solve_ilp
from .analysis.transfers import Candidate, forward_times, offload_candidates, storage_creators
from .problem import Plan, Problem, closure_from_keep_set
from .registry import Decision, planner
from .status import DEFAULT_TIME_LIMIT, BudgetKind, Status, relative_gap

logger = logging.getLogger(__name__)

# The planners offload=True can stand in for (the checkpointing heuristics do not offload).
OFFLOAD_CAPABLE = frozenset({"ilp", "fast", "ilp_peak", "ilp_offload"})


def require_offload(device: str, host_bytes_per_second: float, solver: str) -> None:
    """Raise ValueError, saying what to do, where ``offload=True`` cannot be planned."""
    if host_bytes_per_second <= 0:
        raise ValueError(
            f"offload=True needs a device with a host link, and device {device!r} has none (on a CPU, host "
            f"and device memory are the same: offloading saves nothing). Plan for the accelerator the step will run "
            f"on, e.g. device='h100', or pass a DeviceProfile with host_link_bytes_per_second set"
        )
    if solver not in OFFLOAD_CAPABLE:
        raise ValueError(f"offload=True plans with the ILP (solver 'ilp' or 'fast'); {solver!r} does not offload")


def offload_solver(problem: Problem, solver: str, *, peak: bool) -> tuple[str, dict[str, object]]:
    """The planner (and its options) that ``offload=True`` uses in place of ``solver``: the
    offload ILP for saved-bytes budgets, the peak planner solving its caps with it for peak ones."""
    require_offload(problem.device, problem.host_bytes_per_second, solver)
    if peak:
        return "ilp_peak", {"cap_solver": "ilp_offload"}
    return "ilp_offload", {}


def _nonnegative(lp: pulp.LpProblem, name: str) -> pulp.LpVariable:
    if hasattr(lp, "add_variable"):
        return lp.add_variable(name, 0, None, cat=pulp.LpContinuous)
    return pulp.LpVariable(name, lowBound=0)


@dataclass
class OffloadRows:
    """The host as a third place for a saved storage, added to the keep/recompute model
    (``mip.run_keep.ModelExtension``). ``unit_seconds`` None: no transfer time (the min-bytes model)."""

    problem: Problem
    candidates: dict[int, Candidate]
    quantum: int
    host_budget_bytes: int | None = None
    unit_seconds: float | None = None
    device_budget_units: int | None = None  # the model's budget row: also bounds sends in flight
    host: dict[int, pulp.LpVariable] | None = None

    def add(self, model: Model) -> None:
        lp, values = model.lp, self.problem.values
        host = self.host = {s: binary(lp, f"h{s}") for s in sorted(self.candidates) if s in model.paid}
        for v in model.keep:
            storage = values[v].storage
            if storage in host:  # g_s >= k_v becomes g_s + h_s >= k_v: paid on the device or sent
                lp.get_constraint_by_name(f"pay_{v}").addInPlace(host[storage])
        for storage, h in host.items():
            lp += model.paid[storage] + h <= 1, f"one_place_{storage}"
            for u in self.candidates[storage].early_users:
                if u in model.recompute:
                    lp += h + model.recompute[u] <= 1, f"fetched_in_time_{storage}_{u}"
        if self.host_budget_bytes is not None:
            sizes = self.problem.storage_bytes
            lp += pulp.lpSum(-(-sizes[s] // self.quantum) * h for s, h in host.items()) <= (
                self.host_budget_bytes // self.quantum), "host_budget"
        if self.unit_seconds is None or not host:
            return
        exposed = self._forward_exposure(lp, model) + self._backward_exposure(lp)
        total = max(sum(self.problem.storage_bytes), 1)
        tie = pulp.lpSum(2e-2 * self.problem.storage_bytes[s] / total * h for s, h in host.items())
        lp.setObjective(lp.objective + exposed + tie)  # the tie-break prefers the device when it has room

    def _forward_exposure(self, lp: pulp.LpProblem, model: Model) -> pulp.LpVariable:
        """Lindley's recursion over the sends, and (with a device budget) the in-flight rows."""
        assert self.host is not None and self.unit_seconds is not None
        unit, candidates = self.unit_seconds, self.candidates
        _, forward_total = forward_times(self.problem)
        backlogs: list[tuple[float, pulp.LpAffineExpression]] = []  # (release, backlog in units) per send
        backlog: pulp.LpAffineExpression | int = 0
        previous = 0.0
        for index, storage in enumerate(sorted(self.host, key=lambda s: (candidates[s].release, s))):
            release = candidates[storage].release
            waiting = _nonnegative(lp, f"send_wait{index}")
            lp += waiting >= backlog - (release - previous) / unit, f"send_queue{index}"
            backlog = waiting + (candidates[storage].seconds / unit) * self.host[storage]
            backlogs.append((release, backlog))
            previous = release
        exposed = _nonnegative(lp, "send_exposed")
        lp += exposed >= backlog - (forward_total - previous) / unit, "send_exposed_row"
        if self.device_budget_units is not None:
            self._in_flight_rows(lp, model, backlogs)
        return exposed

    def _in_flight_rows(self, lp: pulp.LpProblem, model: Model,
                        backlogs: list[tuple[float, pulp.LpAffineExpression]]) -> None:
        """After each op that makes a saved storage, the device holds the storages kept so far
        plus every send not done when that op started (a send's wait runs after the op in which
        it completes): that must fit the device budget too. Offloading frees device memory only
        as fast as the link drains it."""
        assert self.host is not None and self.unit_seconds is not None and self.device_budget_units is not None
        unit, values, sizes = self.unit_seconds, self.problem.values, self.problem.storage_bytes
        ends, _ = forward_times(self.problem)
        creators = storage_creators(self.problem)
        per_unit = unit * self.problem.host_bytes_per_second / self.quantum  # backlog units -> byte units
        releases = [release for release, _ in backlogs]
        kept_so_far: pulp.LpAffineExpression | int = 0
        for index, storage in enumerate(sorted(model.paid, key=lambda s: (ends[creators[s]], s))):
            creator = creators[storage]
            start = ends[creator] - values[creator].recompute_seconds
            kept = _nonnegative(lp, f"kept_by{index}")
            lp += kept >= kept_so_far + -(-sizes[storage] // self.quantum) * model.paid[storage], f"kept_by_row{index}"
            kept_so_far = kept
            in_flight: pulp.LpAffineExpression | int = 0
            earlier = bisect.bisect_left(releases, start) - 1  # the last send made before this op began
            if earlier >= 0:
                pending = _nonnegative(lp, f"pending{index}")
                lp += pending >= backlogs[earlier][1] - (start - releases[earlier]) / unit, f"pending_row{index}"
                in_flight = pending
            if storage in self.host:
                in_flight = in_flight + (self.candidates[storage].seconds / unit) * self.host[storage]
            lp += kept + per_unit * in_flight <= self.device_budget_units, f"in_flight{index}"

    def _backward_exposure(self, lp: pulp.LpProblem) -> pulp.LpVariable:
        assert self.host is not None and self.unit_seconds is not None
        unit, candidates = self.unit_seconds, self.candidates
        exposed = _nonnegative(lp, "fetch_exposed")
        done: pulp.LpAffineExpression | int = 0
        for index, storage in enumerate(sorted(self.host, key=lambda s: (candidates[s].deadline, s))):
            finished = _nonnegative(lp, f"fetch_done{index}")
            lp += finished >= done + (candidates[storage].seconds / unit) * self.host[storage], f"fetch_queue{index}"
            lp += exposed >= finished - candidates[storage].deadline / unit, f"fetch_late{index}"
            done = finished
        return exposed

    def plan_from(self, problem: Problem, model: Model, result: MipResult, **fields: object) -> Plan:
        values = result.values
        saved = {v for v, var in model.keep.items() if values.get(var.name, 0.0) > 0.5}
        sent = {s for s, var in (self.host or {}).items() if values.get(var.name, 0.0) > 0.5}
        try:
            had, recomputed = closure_from_keep_set(problem, saved)
            offloaded = frozenset(v for v in had if problem.values[v].storage in sent)
            return Plan(problem=problem, kept=had - offloaded, recomputed=recomputed, offloaded=offloaded,
                        host_budget_bytes=self.host_budget_bytes, **fields)
        except ValueError as error:
            raise SolverError(f"the {result.backend} solution is not a valid plan (numerical trouble?): {error}") from error


def _recompute_only_start(problem: Problem, budget_bytes: int, time_limit: float, backend: str,
                          threads: int | None) -> Plan | None:
    """The keep/recompute optimum at this budget as the MIP start: the offload model's search then
    starts from what recompute alone achieves (the LP bound of the link rows is weak, and on
    large graphs the backend stops at its time limit long before proving optimality)."""
    try:
        return solve_ilp(problem, budget_bytes, time_limit=time_limit, backend=backend, threads=threads)
    except (BudgetInfeasibleError, SolverError):  # offloading may fit budgets recompute alone cannot
        fitting = [p for p in baselines.heuristic_plans(problem) if p.kept_bytes <= budget_bytes]
        return min(fitting, key=lambda p: p.recompute_seconds) if fitting else None


@planner("ilp_offload", description="keep, recompute or offload to host memory: one integer program pricing the "
         "host link's exposed transfer time", exact=True, bounds=BudgetKind.SAVED)
def solve_offload(
    problem: Problem,
    budget_bytes: int,
    *,
    time_limit: float = DEFAULT_TIME_LIMIT,
    backend: str = "auto",
    threads: int | None = None,
    host_budget_bytes: int | None = None,
) -> Decision:
    """The least recompute + exposed transfer time keeping at most ``budget_bytes`` on the device.

    Offloaded values do not count against ``budget_bytes`` (saved device bytes); their bytes
    together stay within ``host_budget_bytes`` (None: unlimited). Without a host link
    (``Problem.host_bytes_per_second`` 0, e.g. device "cpu") nothing can be offloaded and
    this is the keep/recompute ILP. Raises BudgetInfeasibleError when nothing fits, naming the
    smallest budget recompute alone meets: one that surely works (with offload a somewhat
    smaller one may work too; it is not searched for).

    >>> from remat_pass.solvers.problem import BackwardStep, Problem, Value
    >>> x = Value(0, "x", (), storage=0, available=True)
    >>> h = Value(1, "h", (0,), storage=1, recompute_seconds=1.0)  # an expensive matmul
    >>> y = Value(2, "y", (1,), storage=2, recompute_seconds=1.0)
    >>> steps = (BackwardStep((2,), 0, 1.0), BackwardStep((1,), 0, 1.0))
    >>> problem = Problem((x, h, y), (0, 100, 100), frozenset({1, 2}), backward_steps=steps,
    ...                   host_bytes_per_second=1000.0)  # 0.1 s per transfer
    >>> plan = solve_offload(problem, budget_bytes=100)
    >>> sorted(plan.kept), sorted(plan.offloaded), plan.recomputed, plan.exposed_transfer_seconds
    ([2], [1], frozenset(), 0.0)
    """
    began = clock.now()
    candidates = offload_candidates(problem)
    if not candidates:
        plan = solve_ilp(problem, budget_bytes, time_limit=time_limit, backend=backend, threads=threads)
        return Decision.of(plan, plan.status, plan.gap, host_budget_bytes=host_budget_bytes)
    engine = resolve_backend(backend)
    weights = weights_for(problem)
    start = _recompute_only_start(problem, budget_bytes, time_limit / 2, engine, threads)
    rounding = rounding_for(problem)
    for rounding in (rounding, rounding_for(problem, exact=True)) if not rounding.exact else (rounding,):
        rows = OffloadRows(problem, candidates, rounding.quantum, host_budget_bytes, weights.unit_seconds,
                           rounding.budget_units(budget_bytes))
        left = max(time_limit - (clock.now() - began), 0.05)
        outcome = solve_once(problem, budget_bytes, rounding=rounding, weights=weights, time_limit=left,
                             backend=engine, start=start, threads=threads, extension=rows)
        if outcome.status != "infeasible":
            break  # else: rounded units made the budget infeasible; solve unrounded
    if outcome.status == "infeasible":
        # Sending nothing is always allowed, so the model is infeasible only where recompute alone is.
        if start is not None and start.kept_bytes <= budget_bytes:
            logger.warning("ilp_offload: the backend calls budget %d infeasible although %s fits; keeping that plan",
                           budget_bytes, start.solver)
            return Decision.of(start, Status.FEASIBLE, None, host_budget_bytes=host_budget_bytes)
        raise BudgetInfeasibleError(budget_bytes, min_feasible_bytes(problem, time_limit=time_limit, backend=engine),
                                    problem.keep_all_bytes())
    if outcome.plan is None:
        raise SolverError(f"the {engine} backend found no plan for budget {budget_bytes} bytes within "
                          f"time_limit={time_limit:g}s; pass a larger time_limit")
    plan = outcome.plan
    if not outcome.fits:
        raise SolverError(f"ilp_offload plan keeps {plan.kept_bytes} bytes, over the budget of {budget_bytes}; a bug")
    # Never worse than recompute alone at this budget: a search stopped by its time limit can
    # leave an incumbent that offloads more and costs more than its own start.
    if start is not None and start.kept_bytes <= budget_bytes and (
            start.predicted_extra_seconds < plan.predicted_extra_seconds):
        logger.info("ilp_offload: the recompute-only plan (%.6g s) beats the offload incumbent (%.6g s); keeping it",
                    start.predicted_extra_seconds, plan.predicted_extra_seconds)
        return Decision.of(start, Status.FEASIBLE, None, host_budget_bytes=host_budget_bytes)
    # Optimal only when the run is certified (solve_once: a believed proof, in budget) on the
    # byte-exact model, for the model's conservative link bound; otherwise feasible or stopped.
    if outcome.certified and rounding.exact:
        status, gap = Status.OPTIMAL, 0.0
    elif outcome.status == "optimal":
        status, gap = Status.FEASIBLE, None
    else:
        status, gap = Status.TIME_LIMIT, relative_gap(outcome.result.objective or 0.0, outcome.bound)
    logger.info("ilp_offload: budget %d B: kept %d B, offloaded %d B, recompute %.6g s, exposed %.6g s (%s, %.2fs)",
                budget_bytes, plan.kept_bytes, plan.offloaded_bytes, plan.recompute_seconds,
                plan.exposed_transfer_seconds, status, clock.now() - began)
    return Decision.of(plan, status, gap)
