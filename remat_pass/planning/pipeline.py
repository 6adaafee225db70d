"""The pipeline driver: resolve the budget, trace, plan, rewrite, reconcile.

Every front door goes through here: ``optimize`` and ``backend`` (per captured joint graph,
``plan_joint_graph``), ``plan``, ``explain`` and ``sweep`` (one traced step, ``trace_step`` then
``plan_problem``). The stages themselves live in their own modules (``capture``, ``annotate``,
``solvers``, ``rewrite``, ``simulate``); this module only decides the order and what a budget means:

1. resolve the budget once (``resolve_budget``): its kind ("saved" or "peak"), the user's budget
   in bytes, and the solver's target (a peak budget less the headroom the graphs do not show);
2. plan (``plan_problem``), falling back to the smallest feasible budget only when asked to;
3. rewrite the joint graph into forward and backward (``rewrite``);
4. reconcile: replay the rewritten graphs (``simulate``) as an independent check of the plan's
   peak, re-plan a little lower where they disagree, and fail loudly rather than overshoot.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from torch import fx

from remat_pass import solvers
from remat_pass.solvers.problem import Plan, Problem
from remat_pass.solvers.tags import Tag

from ..annotate.annotate import AnnotatedGraph, annotate
from ..annotate.baseline import as_given_plan, has_checkpoint_regions
from .budget import Budget
from .effort import FAST_TIME_LIMIT, effort_options
from ..capture.capture import JointGraph
from ..annotate.costs import CostModel, DeviceProfile
from ..errors import RematError
from .fused_free import recompute_fused_free
from .kept_cap import keeping_at_most
from .progress import solving
from ..rewrite.rewrite import rewrite
from ..rewrite.simulate import simulate
from ..runtime.plan_cache import cache_key
from .tracing import LossFn, TracedStep, as_inputs, merge_problems, trace_step

logger = logging.getLogger(__name__)

DEFAULT_BUDGET = 0.5
"""Half the activation bytes: usually attainable by recomputing only cheap ops."""

class BudgetKind(str, enum.Enum):
    """What a user's budget bounds: the planners' ``solvers.BudgetKind`` (saved, peak) plus "auto",
    the rule that picks one from the budget's form. A ``str``, so ``kind == "peak"`` holds for
    either enum and JSON is unchanged."""

    AUTO = "auto"  # a fraction bounds saved bytes, an absolute size the peak (resolve_budget_kind)
    SAVED = "saved"  # bytes saved for backward
    PEAK = "peak"  # the step's simulated activation peak

    def __str__(self) -> str:
        return self.value


class OnInfeasible(str, enum.Enum):
    """What to do with a graph (a piece of a split step) that cannot meet the budget."""

    RAISE = "raise"  # BudgetInfeasibleError with that piece's smallest feasible budget
    CLAMP = "clamp"  # plan that piece at its smallest feasible budget, with a warning naming it

    def __str__(self) -> str:
        return self.value


def resolve_budget_kind(budget: Budget, kind: str) -> BudgetKind:
    """"auto": a fraction bounds saved bytes, an absolute size bounds the step's peak.

    A fraction is relative to what the un-rematerialized step saves, so "saved" is what it
    naturally means; an absolute size is what a user's device can hold, so it must bound the
    peak — a bound on saved bytes alone can be met by a plan that peaks higher.
    """
    try:
        resolved = BudgetKind(kind)
    except ValueError:
        raise ValueError(f"budget_kind must be one of {tuple(k.value for k in BudgetKind)}, got {kind!r}") from None
    if resolved is not BudgetKind.AUTO:
        return resolved
    return BudgetKind.SAVED if budget.fraction is not None else BudgetKind.PEAK


@dataclass(frozen=True)
class PlanOptions:
    """How plans are made. ``device`` says where the step runs ("auto", "cpu", "a100", "h100",
    "h200" or a ``DeviceProfile``), ``costs`` how recompute is priced ("roofline", "flops",
    "measure"); ``budget_kind`` says what the budget bounds ("auto", "saved", "peak")."""

    budget: Budget
    solver: str = "ilp"
    device: str | DeviceProfile = "auto"
    time_limit: float = FAST_TIME_LIMIT
    budget_kind: str = BudgetKind.AUTO
    solver_options: dict[str, Any] = field(default_factory=dict)
    free_inputs: bool = False  # see annotate(): True only when each graph is a whole step
    # A budget a graph cannot meet: fail ("raise"), or plan that graph at its smallest feasible
    # budget and say so ("clamp": the registered "remat" backend's default, whose budget is a
    # preference, and a choice for split steps whose small pieces cannot reach the budget).
    on_infeasible: OnInfeasible = OnInfeasible.RAISE
    # Offload: saved values may also go to host memory (solvers.offload_planner; emitted by
    # remat_pass.rewrite.offload), within host_budget_bytes (None: unlimited).
    offload: bool = False
    host_budget_bytes: int | None = None
    # Where solved plans are stored and looked up (plan_cache.PlanCache); not a planning input.
    plan_cache: Any = field(default=None, compare=False, repr=False)
    costs: CostModel = CostModel.ROOFLINE
    # The proof work (exact rows, the any-schedule bound) within time_limit, or none (the default:
    # planning_effort); planners without such work (the ILP, "fast", the baselines) ignore it.
    prove: bool = False
    fused_prices: bool = True  # under Inductor, recompute priced fused into readers (annotate.fused_costs)
    fused_memory: bool = True  # under Inductor, backward tensors fused into their readers unallocated (same)
    # Without proof work, search on before refusing a budget (effort.REFUSAL_TIME_LIMIT); off where a
    # refusal is not the answer the user gets (the Inductor fit then tries another budget: inductor_fit).
    search_before_refusing: bool = True
    # A refused peak budget's error states a minimum a probe of the trade-off curve found (off for the
    # Inductor fit's re-asked candidates: their refusal's minimum is never read; inductor_fit).
    probe_minimum: bool = True
    # A piece of a step split at graph breaks keeps at most this for backward, what leaves the later
    # pieces what they need (runtime.earlier_pieces; met by planning.kept_cap); None: no such bound.
    kept_cap_bytes: int | None = None


# --- the budget -------------------------------------------------------------------------------


def pinned_budget(options: PlanOptions, budget_bytes: int, kind: str) -> PlanOptions:
    """``options`` with the budget fixed at the bytes it meant for one graph, for a rewrite of that
    graph (the loss chunked): a fraction is of the step as the user wrote it, and the rewritten
    graph's own keep-all would resolve it to other bytes."""
    return replace(options, budget=Budget(nbytes=budget_bytes), budget_kind=kind)


# A peak budget is planned with headroom for what neither memory model shows: the few small
# tensors the autograd runtime allocates around the graphs, and the allocator's rounding. Kernel
# scratch is no longer part of it: annotate measures it per op (remat_pass.annotate.scratch). Derived from
# measurement, allocator peak - predicted peak with scratch measured (benchmarks/RESULTS.md):
# ResNet on CPU (fp32, bf16) -3.5 / -1.8 KB, on an H200 -4.2 / -2.2 KB; Hugging Face GPT-2, Llama,
# BERT on CPU (loss inside the step) +4 B to +12.0 KiB (12292 B, BERT per_block); no row showed
# a residual that grows with the step. So: no fraction, and the largest residual, rounded up.
PEAK_HEADROOM_FRACTION = 0.0
PEAK_HEADROOM_BYTES = 16 * 1024


def without_headroom(budget_bytes: int) -> int:
    """The solver's target for a peak budget: the budget less the headroom."""
    return max(int(budget_bytes * (1 - PEAK_HEADROOM_FRACTION)) - PEAK_HEADROOM_BYTES, 1)


def with_headroom(planned_bytes: int) -> int:
    """The smallest budget whose headroom-reduced value is ``planned_bytes`` or more."""
    budget = int((planned_bytes + PEAK_HEADROOM_BYTES) / (1 - PEAK_HEADROOM_FRACTION))
    while without_headroom(budget) < planned_bytes:
        budget += 1
    return budget


@dataclass(frozen=True)
class ResolvedBudget:
    """A budget against one problem: what the user asked for and what the solver is asked for.

    ``budget_bytes`` is the user's budget in bytes (a fraction resolved against
    ``reference_bytes``: the keep-all saved bytes for "saved", the keep-all peak for "peak");
    ``target_bytes`` is what the solver plans to (for "peak", less the headroom).
    """

    requested: Budget
    kind: BudgetKind
    budget_bytes: int
    target_bytes: int
    reference_bytes: int
    as_given: Plan | None = field(default=None, repr=False, compare=False)


def resolve_budget(problem: Problem, budget: Budget, kind: str = BudgetKind.AUTO) -> ResolvedBudget:
    """The one place a budget becomes bytes for ``problem``.

    The reference is the model as given (``baseline.as_given_plan``: keep-all, less what the
    model's own checkpoint regions recompute): a fraction is relative to what it saves (or its
    peak), and no budget lets the solver hold more than it does. A graph piece's own inputs
    (``Tag.PIECE_INPUT``: a graph break's activations, or a backend-compiled step's inputs) are
    kept by every plan that reads them and cannot be recomputed there, so a saved-bytes fraction
    is of what the piece keeps beyond them, with them on top: the same fraction means the same
    share of the activations with ``optimize`` (whose inputs are free) and with the backend, and
    a small piece whose input dwarfs its activations can still meet it (a 2-rank tensor-parallel
    MLP at 0.3 was refused: its input alone was 0.38 of its keep-all).
    """
    resolved = resolve_budget_kind(budget, kind)
    given = as_given_plan(problem)
    if resolved is BudgetKind.PEAK:
        reference = solvers.simulate_plan(problem, given).peak_bytes
        budget_bytes = budget.resolve(reference)
        return ResolvedBudget(budget, resolved, budget_bytes, without_headroom(budget_bytes), reference, given)
    reference = given.kept_bytes
    inputs = kept_input_bytes(problem, given)
    budget_bytes = budget.resolve(reference) if budget.fraction is None else inputs + budget.resolve(reference - inputs)
    if budget_bytes > reference:
        logger.info("saved-bytes budget %d is above what the model as given saves; planning within its %d bytes",
                    budget_bytes, reference)
    return ResolvedBudget(budget, resolved, budget_bytes, min(budget_bytes, reference), reference, given)


def kept_input_bytes(problem: Problem, plan: Plan) -> int:
    """Bytes of the graph's own inputs (``Tag.PIECE_INPUT`` storages) that ``plan`` keeps."""
    inputs = {value.storage for value in problem.values if Tag.PIECE_INPUT in value.tags}
    kept = {problem.values[i].storage for i in plan.kept} & inputs
    return sum(problem.storage_bytes[storage] for storage in kept)


def _in_input_terms(error: solvers.BudgetInfeasibleError, problem: Problem,
                    budget: ResolvedBudget) -> solvers.BudgetInfeasibleError:
    """A saved-bytes error that suggests a fraction as ``resolve_budget`` reads one for this piece."""
    inputs = kept_input_bytes(problem, budget.as_given) if budget.as_given is not None else 0
    if error.kind == BudgetKind.PEAK or not inputs:
        return error
    return solvers.BudgetInfeasibleError(error.budget_bytes, error.min_bytes, error.keep_all_bytes, error.kind,
                                         proven_min_bytes=error.proven_min_bytes, input_bytes=inputs)


# --- planning ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """A plan and the budget it was made for (``plan.budget_bytes`` is ``budget.budget_bytes``)."""

    plan: Plan
    budget: ResolvedBudget


def plan_problem(problem: Problem, options: PlanOptions) -> Planned:
    """Resolve the budget against ``problem`` and solve; the plan carries its predicted peak.

    Raises BudgetInfeasibleError (in the user's terms: a peak error names the smallest budget
    that works with the headroom) unless ``options.on_infeasible`` is "clamp". A solve that runs
    longer than a few seconds is reported while it runs, and its status and proven gap when it ends
    (``progress.solving``: the log at INFO, and a status line when stderr is a terminal).
    """
    cache = options.plan_cache
    key = cache_key(problem, options) if cache is not None else None  # hashed once, for the lookup and the store
    if cache is not None and (found := cache.get(problem, options, key)) is not None:
        plan, budget = found
        return Planned(plan, resolve_budget(problem, Budget(budget["fraction"], budget["nbytes"]), budget["kind"]))
    what = f"a {options.solver} plan for {len(problem.values)} values under budget {options.budget}"
    with solving(what, options.time_limit) as outcome:
        planned = _plan_or_clamp(problem, options)
        outcome.text = describe_status(planned.plan)
    if cache is not None:
        requested = planned.budget.requested
        cache.put(problem, options, planned.plan,
                  {"fraction": requested.fraction, "nbytes": requested.nbytes, "kind": planned.budget.kind.value}, key)
    return planned


def _plan_or_clamp(problem: Problem, options: PlanOptions) -> Planned:
    budget = resolve_budget(problem, options.budget, options.budget_kind)
    try:
        _warn_if_the_loss_is_outside(problem, budget)
        return _solve(problem, options, budget)
    except solvers.BudgetInfeasibleError as error:
        if OnInfeasible(options.on_infeasible) is OnInfeasible.RAISE:
            raise _in_input_terms(error, problem, budget) from None
        logger.warning("the budget (%s) is infeasible for the graph of %s; on_infeasible='clamp': planning it at "
                       "its smallest feasible budget, %d bytes (%.4f of its keep-all %s)", options.budget,
                       describe_piece(problem), error.min_bytes, error.min_bytes / max(error.keep_all_bytes, 1),
                       "peak" if error.kind == BudgetKind.PEAK else "bytes")
        kind = resolve_budget_kind(options.budget, options.budget_kind)
        return _solve(problem, options, resolve_budget(problem, Budget(nbytes=error.min_bytes), kind))


# A forward output bigger than this (and than 1% of the budget) is not a loss: the loss is computed
# outside the planned graph.
_LOSS_OUTPUT_BYTES = 1024


def _warn_if_the_loss_is_outside(problem: Problem, budget: ResolvedBudget) -> None:
    """A peak budget covers the planned graph only; say so when its outputs are not a loss.

    Measured (benchmarks/GPU.md, run 2): a 50k-vocabulary loss outside the plan put the step's
    peak 26-28% over the budget, because the loss's own tensors (its softmax, the logits'
    gradient) come on top of what the planned graph holds.
    """
    if budget.kind is not BudgetKind.PEAK or not problem.forward_outputs:
        return
    # The largest output: buffers a step updates (BatchNorm's statistics) are outputs too, but small.
    largest = max(problem.forward_outputs, key=lambda i: problem.storage_bytes[problem.values[i].storage])
    output_bytes = problem.storage_bytes[problem.values[largest].storage]
    if output_bytes > max(_LOSS_OUTPUT_BYTES, budget.budget_bytes // 100) and not _loss_made_from(problem, largest):
        logger.warning("the peak budget covers this graph (%s) only: its output (%d bytes) is not a scalar "
                       "loss, so a loss computed from it outside adds its own memory on top (about the "
                       "output's size again, or more). Compile the loss with the model to bound the whole step.",
                       describe_piece(problem), output_bytes)


def _loss_made_from(problem: Problem, largest: int) -> bool:
    """Whether a one-number output (8 bytes at most) is computed from ``largest`` in the graph: a loss
    the model returns beside its logits (Hugging Face given ``labels``), which the budget then covers."""
    small = [i for i in problem.forward_outputs if problem.storage_bytes[problem.values[i].storage] <= 8]
    seen, stack = set(small), list(small)
    while stack:
        for parent in problem.values[stack.pop()].inputs:
            if parent == largest:
                return True
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return False


def describe_piece(modules: Problem | list[str]) -> str:
    """The modules a graph covers ("blocks.0.attn .. blocks.1.mlp"), to name a piece of a split step."""
    if isinstance(modules, Problem):
        modules = [value.module for value in modules.values if value.module]
    if not modules:
        return "a graph outside any submodule"
    return modules[0] if modules[0] == modules[-1] else f"{modules[0]} .. {modules[-1]}"


def _solve(problem: Problem, options: PlanOptions, budget: ResolvedBudget) -> Planned:
    if not options.offload:
        return _solve_one(problem, options, budget)
    return _better_of_offload_and_recompute(problem, options, budget)


def _better_of_offload_and_recompute(problem: Problem, options: PlanOptions, budget: ResolvedBudget) -> Planned:
    """Offloading is a third choice, never a worse one: the offload search stops at its time limit
    on large graphs and can end above what recompute alone reaches at the same budget, so the
    recompute-only plan is made too and the one with less predicted extra time is used."""
    with_offload = _solve_one(problem, options, budget)
    try:
        recompute_only = _solve_one(problem, replace(options, offload=False), budget)
    except solvers.BudgetInfeasibleError:
        return with_offload  # offloading fits a budget recompute alone cannot
    if recompute_only.plan.predicted_extra_seconds < with_offload.plan.predicted_extra_seconds:
        logger.info("offload: the recompute-only plan (+%.6g s) beats the offload plan (+%.6g s); using it",
                    recompute_only.plan.predicted_extra_seconds, with_offload.plan.predicted_extra_seconds)
        return recompute_only
    return with_offload


def _solve_one(problem: Problem, options: PlanOptions, budget: ResolvedBudget) -> Planned:
    extra = dict(options.solver_options)
    solver = options.solver
    if options.offload:
        solver, offload_options = solvers.offload_solver(problem, solver, peak=budget.kind is BudgetKind.PEAK)
        extra.update(offload_options, host_budget_bytes=options.host_budget_bytes)
    elif solver in ("ilp", "fast") and budget.kind is BudgetKind.PEAK:
        extra["cap_solver"] = solver  # the peak search solves saved-bytes caps with this solver
        solver = "ilp_peak"
    if _bounds_budget(solver):  # the planners that search for a budget take a time limit (effort)
        for name, value in effort_options(solver, options.time_limit, options.prove,
                                          options.search_before_refusing, options.probe_minimum).items():
            extra.setdefault(name, value)
    if budget.kind is BudgetKind.PEAK and not options.offload and _as_given_fits(problem, solver, budget):
        plan = _no_more_than_as_given(problem, options, budget)
    elif budget.kind is BudgetKind.PEAK:
        try:
            plan = solvers.solve(problem, budget.target_bytes, solver=solver, **extra)
        except solvers.BudgetInfeasibleError as error:
            raise solvers.BudgetInfeasibleError(
                budget.budget_bytes, with_headroom(error.min_bytes), budget.reference_bytes, kind="peak",
                lowest_kept_bytes=error.lowest_kept_bytes, headroom_bytes=PEAK_HEADROOM_BYTES) from None
        plan = replace(plan, budget_bytes=budget.budget_bytes)
    else:
        try:
            plan = solvers.solve(problem, budget.target_bytes, solver=solver, **extra)
        except solvers.BudgetInfeasibleError:
            if budget.as_given is None or budget.target_bytes < budget.reference_bytes:
                raise
            plan = replace(budget.as_given, budget_bytes=budget.target_bytes)  # the solver rounded; the model's plan fits
    if plan.predicted_peak_bytes is None:
        plan = replace(plan, predicted_peak_bytes=solvers.simulate_plan(problem, plan).peak_bytes)
    return Planned(plan, budget)


def _bounds_budget(solver: str) -> bool:
    """Whether the registry says this planner searches for a budget (a planner registered in
    ``SOLVERS`` alone, as tests do, has no metadata: it does not)."""
    info = solvers.SOLVER_INFO.get(solver)
    return info is not None and info.bounds is not None


def _as_given_fits(problem: Problem, solver: str, budget: ResolvedBudget) -> bool:
    """A peak budget the model's own checkpointing already meets: plan within what it saves.

    Only for models that checkpoint (otherwise the as-given plan is keep-all and the peak
    search finds it) and for the budgeted solvers (a baseline solver is asked for by name).
    """
    return (budget.as_given is not None and budget.budget_bytes >= budget.reference_bytes
            and _bounds_budget(solver) and has_checkpoint_regions(problem))


def _no_more_than_as_given(problem: Problem, options: PlanOptions, budget: ResolvedBudget) -> Plan:
    """The cheapest plan that saves no more than the model as given and peaks no higher;
    the model's own plan where the solver finds none better."""
    given = budget.as_given
    assert given is not None
    effort = effort_options(options.solver, options.time_limit, options.prove, options.search_before_refusing,
                            options.probe_minimum)
    try:  # the user's options win over the effort's, as in _solve_one
        plan = solvers.solve(problem, given.kept_bytes, solver=options.solver, **{**effort, **options.solver_options})
    except solvers.BudgetInfeasibleError:
        plan = given
    if solvers.simulate_plan(problem, plan).peak_bytes > budget.reference_bytes:
        plan = given
    return replace(plan, budget_bytes=budget.budget_bytes, budget_kind=BudgetKind.PEAK.value)


# --- one joint graph: plan, rewrite, reconcile ------------------------------------------------


@dataclass(frozen=True)
class PlannedGraph:
    """What the pipeline makes of one joint graph: the plan, its budget, the rewritten graphs and
    their replayed peak (``graph_peak_bytes``, from ``simulate``: the independent check)."""

    plan: Plan
    budget: ResolvedBudget
    forward: fx.GraphModule
    backward: fx.GraphModule
    graph_peak_bytes: int
    annotated: AnnotatedGraph = field(repr=False, compare=False)


def plan_joint_graph(joint: JointGraph, options: PlanOptions) -> PlannedGraph:
    """The whole pipeline for one joint graph: annotate, plan, rewrite, reconcile."""
    started = time.perf_counter()
    store = getattr(options.plan_cache, "scratch_directory", None)  # beside the plans, where they are cached
    annotated = annotate(joint, options.device, free_inputs=options.free_inputs, costs=options.costs,
                         fused_prices=options.fused_prices, fused_memory=options.fused_memory, scratch_store=store)
    planned = keeping_at_most(options, plan_problem(annotated.problem, options),
                              lambda lowered: plan_problem(annotated.problem, lowered))
    planned = replace(planned, plan=as_compiled(annotated, planned.plan))
    forward, backward = rewrite(annotated, planned.plan)
    result = reconcile(annotated, options, planned, forward, backward)
    plan = result.plan
    logger.info(
        "planned %d forward values in %.2fs: keep %d of %d bytes, recompute %d values, peak ~%d bytes (%s, %s)",
        len(annotated.problem.values), time.perf_counter() - started, plan.kept_bytes,
        plan.keep_all_bytes, len(plan.recomputed), result.graph_peak_bytes, plan.solver, describe_status(plan),
    )
    return result


def as_compiled(annotated: AnnotatedGraph, plan: Plan) -> Plan:
    """The plan for the program that runs: under Inductor, what it fuses for free is recomputed
    rather than kept (``fused_free``); under eager, the plan as made."""
    return recompute_fused_free(annotated, plan) if annotated.joint.compiler == "inductor" else plan


def describe_status(plan: Plan) -> str:
    """"optimal", or "feasible, proven gap 17.5%" / "feasible, gap unknown": never more than was proven."""
    if plan.status == solvers.Status.OPTIMAL:
        return str(plan.status)
    return f"{plan.status}, gap unknown" if plan.gap is None else f"{plan.status}, proven gap {plan.gap:.1%}"


def reconcile(annotated: AnnotatedGraph, options: PlanOptions, planned: Planned,
              forward: fx.GraphModule, backward: fx.GraphModule) -> PlannedGraph:
    """Replay the rewritten graphs as an independent check of the plan-level peak prediction.

    A peak budget the graphs would break is re-planned a little lower (the two models disagree
    by a few bytes at most), and an error if that does not help — never a silent overshoot.
    """
    plan = planned.plan
    simulated = simulate(forward, backward).peak_bytes
    for _ in range(3):
        if plan.budget_kind != BudgetKind.PEAK or plan.budget_bytes is None or simulated <= plan.budget_bytes:
            break
        margin = simulated - (plan.predicted_peak_bytes or simulated)
        logger.info("graph-level peak %d over the %d-byte budget; re-planning %d bytes lower",
                    simulated, plan.budget_bytes, max(margin, 1))
        tighter = replace(options, budget=Budget(nbytes=max(plan.budget_bytes - max(margin, 1), 1)),
                          budget_kind=BudgetKind.PEAK)
        plan = replace(as_compiled(annotated, plan_problem(annotated.problem, tighter).plan),
                       budget_bytes=plan.budget_bytes)
        forward, backward = rewrite(annotated, plan)
        simulated = simulate(forward, backward).peak_bytes
    if plan.budget_kind == BudgetKind.PEAK and plan.budget_bytes is not None and simulated > plan.budget_bytes:
        raise RematError(
            f"internal error: the rewritten graphs peak at {simulated} bytes, over the {plan.budget_bytes}-byte "
            f"budget (plan-level prediction {plan.predicted_peak_bytes}); please report it"
        )
    logger.debug("graph-level peak %d vs plan-level %s", simulated, plan.predicted_peak_bytes)
    return PlannedGraph(plan, planned.budget, forward, backward, simulated, annotated)


__all__ = [
    "DEFAULT_BUDGET", "BudgetKind", "LossFn", "OnInfeasible", "PlanOptions", "Planned", "PlannedGraph",
    "ResolvedBudget", "TracedStep", "as_inputs", "merge_problems", "plan_joint_graph", "plan_problem", "reconcile",
    "as_compiled", "describe_piece", "describe_status", "resolve_budget", "resolve_budget_kind", "trace_step", "with_headroom", "without_headroom",
]
