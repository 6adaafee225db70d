"""The ``torch.compile`` backend: each captured joint graph goes through ``pipeline.plan_joint_graph``.

``torch.compile(model, backend="remat")`` uses the default budget (see ``DEFAULT_BUDGET``);
``torch.compile(model, backend=remat_pass.backend(budget="1GiB"))`` chooses. The two graphs a plan
makes are compiled by Inductor (``BACKEND_INNER``): a user who chose ``torch.compile`` chose it for
Inductor's speed, and a backend that ran the step op by op is slower than the compile it replaced
(benchmarks/GPU.md: 1.41x eager's step where Inductor took 0.90x). Under a saved-bytes budget what
is kept for backward is the plan's whatever compiles it. Under a peak budget the planner's peak
model is of the unfused program, which Inductor's fused one does not follow (up to 22% over or
15% under, benchmarks/VS_INDUCTOR.md), so the plan is fitted to the compiled program: candidate
plans are compiled and their steps measured until one fits (``inductor_fit``, in the order of
``peak_fitting``); where none does,
the graph runs eager (``inner="eager"``, whose peak the model describes), unless Inductor was
asked for by name (then ``BudgetInfeasibleError``, or "clamp").
The name "remat" is registered through the ``torch_dynamo_backends`` entry point in
pyproject.toml, which is how torch discovers third-party backends.

Where a training framework selects the backend by a string in its config (torchtitan's
``compile.backend``), no budget object can be passed: the registered "remat" backend reads its
settings from the environment instead (the one documented exception to "no environment
variables"), at each compile:

* ``REMAT_PASS_BUDGET``: ``0.3`` (a number with a decimal point: a fraction of keep-all) or a
  size (``2GiB``, ``500MB``, ``1000000`` bytes); default ``DEFAULT_BUDGET``;
* ``REMAT_PASS_BUDGET_KIND``: ``auto`` (default), ``saved`` or ``peak``;
* ``REMAT_PASS_ON_INFEASIBLE``: ``clamp`` (default: a graph that cannot meet the budget is
  planned at its own minimum, with a warning) or ``raise``;
* ``REMAT_PASS_INNER``: ``inductor`` (default) or ``eager``;
* ``REMAT_PASS_PLAN_CACHE``: a directory for the plan cache, or ``off``; default
  ``~/.cache/remat_pass/plans`` (``plan_cache.DEFAULT_DIRECTORY``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import uuid
from dataclasses import replace
from typing import Any, Callable, Iterator

import torch
from torch import fx

from remat_pass import solvers
from remat_pass.solvers.problem import Plan

from ..planning.budget import Budget, parse_budget
from ..annotate.attribution import module_path
from ..capture.capture import INNER_COMPILERS, JointGraph, make_dynamo_backend
from ..capture.frozen_objects import older_objects_frozen
from ..capture.precompiled import program_stored_as_returned
from ..capture.loss_chunking import (ChunkLoss, LossGradients, as_chunk_loss, chunk_for_budget, chunkable,
                                     chunking_extra_flops, would_split)
from ..planning.loss_choice import Pin, choose_loss
from ..compat import compiling_frame, has_custom_partitioner
from ..annotate.costs import CostModel, DeviceProfile, parse_costs
from ..rewrite.offload import check_offload_options, parse_host_budget
from .earlier_pieces import Beside, bounds_the_step_peak, left_for_piece
from .inductor_fit import SamePlan, plan_identity
from .peak_fitting import PeakFitting
from .plan_cache import PlanCache, Refusal, Renewed, Unplanned, as_plan_cache, compiled_key
from .plan_cache import from_text as plan_cache_from_text
from ..planning.progress import phase
from ..errors import InvalidBudgetError
from ..planning.pipeline import (
    DEFAULT_BUDGET,
    BudgetKind,
    OnInfeasible,
    PlanOptions,
    describe_piece,
    plan_joint_graph,
    resolve_budget_kind,
)
from ..planning.effort import planning_effort

logger = logging.getLogger(__name__)

ENV_BUDGET, ENV_BUDGET_KIND, ENV_ON_INFEASIBLE = "REMAT_PASS_BUDGET", "REMAT_PASS_BUDGET_KIND", "REMAT_PASS_ON_INFEASIBLE"
ENV_INNER = "REMAT_PASS_INNER"
ENV_PLAN_CACHE = "REMAT_PASS_PLAN_CACHE"

# The torch.compile backend's inner compiler unless one is named (``optimize`` keeps "eager").
BACKEND_INNER = "inductor"


def backend_inner(inner: str | None, kind: BudgetKind = BudgetKind.SAVED) -> str:
    """``inner``, or the backend's default for a budget of either ``kind``: Inductor, where this
    torch lets a partitioner of ours run inside it (``custom_partitioner_fn``), eager with a
    warning saying why if not. Under a peak budget the plan is fitted to Inductor's compiled
    program by measurement (``inductor_fit``); where that fails, the default falls back to eager."""
    if inner is not None:
        if inner not in INNER_COMPILERS:
            raise ValueError(f"inner must be one of {INNER_COMPILERS}, got {inner!r}")
        return inner
    if BACKEND_INNER == "inductor" and not has_custom_partitioner():
        logger.warning("torch %s has no torch._inductor.config.custom_partitioner_fn: the remat backend "
                       "runs its graphs with inner='eager' (Inductor needs a newer torch)", torch.__version__)
        return "eager"
    return BACKEND_INNER


class RematBackend(PeakFitting):
    """A dynamo backend object; it remembers the plan of every subgraph it compiled.

    ``plans`` lists them in compile order. ``on_plan`` (used by ``optimize``) is called with
    each new plan as soon as it exists. ``plan_cache`` stores solved plans on disk and reuses them
    when the same graph is planned with the same inputs: by default in ``~/.cache/remat_pass/plans``
    (``plan_cache.DEFAULT_DIRECTORY``); a ``PlanCache`` or a directory to choose, ``False`` for none.

    ``on_infeasible``: when one graph (a piece of a step dynamo split at graph breaks, DDP's
    gradient buckets or FSDP2's hooks) cannot meet the budget, "raise" (default) fails the
    compile with BudgetInfeasibleError naming the piece and its minimum; "clamp" plans that
    piece at its minimum and logs a warning saying so.

    ``pieces``: the budget covers this many graphs the backend will compile, such as ``n``
    identical blocks each compiled with it (``apply_to_blocks(per="step")``). A fraction
    needs no split (the same fraction of each piece is that fraction of their sum); an absolute
    budget becomes ``budget // pieces`` bytes *saved for backward* per piece, whose sum is then
    at most the budget. Peaks do not add up across pieces, so a peak budget cannot be split.

    ``time_limit`` and ``prove``: how long each graph's planning may take and whether it does the
    proof work (``effort.planning_effort``: by default 2 s and none, as for ``optimize``).

    ``chunk_loss``: compute a language-model loss (linear head, row-wise chain, cross-entropy)
    in chunks of tokens, its gradients computed with it in forward (or recomputed in backward:
    ``capture.loss_chunking.LossGradients``): True always, a ``ChunkLoss`` to set the chunk's
    bytes and the gradients, False never; None (default) by ``planning.loss_choice``'s rule:
    where the budget cannot be met with the loss whole, or is met whole only with more work than
    chunked (the candidates are all planned then, and ``on_plan`` sees each); a step that fits
    without recompute is never changed. Under the Inductor fit (``inner="inductor"`` with a
    peak budget) None chunks only where the whole loss cannot be fitted to the budget.
    """

    def __init__(
        self,
        budget: object = DEFAULT_BUDGET,
        *,
        inner: str | None = None,
        solver: str = "ilp",
        device: str | DeviceProfile = "auto",
        time_limit: float | None = None,
        prove: bool | None = None,
        budget_kind: str = BudgetKind.AUTO,
        on_plan: Callable[[Plan], None] | None = None,
        free_inputs: bool = False,
        offload: bool = False,
        host_budget: object = None,
        on_infeasible: str = OnInfeasible.RAISE,
        pieces: int = 1,
        plan_cache: PlanCache | str | os.PathLike[str] | bool | None = True,
        costs: str = CostModel.ROOFLINE,
        chunk_loss: bool | ChunkLoss | None = None,
        **solver_options: Any,
    ) -> None:
        chunking = as_chunk_loss(chunk_loss)  # a bad value is a TypeError now
        solvers.get_solver(solver)  # an unknown name is a ValueError naming the choices
        parsed = parse_budget(budget)
        resolve_budget_kind(parsed, budget_kind)  # reject a bad kind now, not at the first call
        check_offload_options(offload, device, solver)
        try:
            on_infeasible = OnInfeasible(on_infeasible)
        except ValueError:
            raise ValueError(f"on_infeasible must be 'raise' or 'clamp', got {on_infeasible!r}") from None
        parsed, budget_kind = _per_piece(parsed, budget_kind, pieces)
        inner_chosen = inner is not None
        inner = backend_inner(inner, resolve_budget_kind(parsed, budget_kind))
        time_limit, prove = planning_effort(time_limit, prove)
        self.options = PlanOptions(parsed, solver, device, time_limit, budget_kind, solver_options, free_inputs,
                                   on_infeasible=on_infeasible, offload=offload,
                                   host_budget_bytes=parse_host_budget(host_budget),
                                   plan_cache=as_plan_cache(plan_cache), costs=parse_costs(costs), prove=prove)
        self.pieces = pieces
        self.inner = inner
        self.plans: list[Plan] = []
        self._on_plan = on_plan
        self._lock = threading.Lock()
        self._compile = make_dynamo_backend(self._partition, inner, chunking, self)
        self._chunk_when_infeasible = chunk_loss is None
        # Inductor under a peak budget: the budget is fitted to the compiled program (inductor_fit).
        self.fits_compiled_peak = inner == "inductor" and resolve_budget_kind(parsed, budget_kind) is BudgetKind.PEAK
        # Inductor by default, not by request: a budget it cannot be fitted to runs eager instead.
        self._eager_fallback = (make_dynamo_backend(self._partition, "eager", chunking, self)
                                if self.fits_compiled_peak and not inner_chosen else None)
        # .asked, .seen, .made, .answered (by Inductor's caches): one fitting attempt on this thread
        self._fitting = threading.local()
        self._choosing = threading.local()  # .pin, .strict: a candidate of the loss's chunking, this thread
        self._step = threading.local()  # .beside: where optimize's graph compiled now stands in its step
        self._warned_of_pieces = False
        self._frames: set[int] = set()  # dynamo's frames compiled here (``compat.compiling_frame``)

    @contextlib.contextmanager
    def beside_other_pieces(self, beside: Beside) -> Iterator[None]:
        """Compile the graphs asked for in the block as a piece of a step split into pieces
        (``optimize``'s call, at graph breaks): an absolute peak budget is what the other pieces
        leave of it (``earlier_pieces``)."""
        before = getattr(self._step, "beside", None)
        self._step.beside = beside
        try:
            yield
        finally:
            self._step.beside = before

    def _options_now(self) -> PlanOptions:
        """The options of this plan: a fitting attempt's own peak budget (``inductor_fit``), a
        candidate of the loss's chunking (strict, its budget pinned: ``loss_choice``), or the user's."""
        options = left_for_piece(self.options, getattr(self._step, "beside", None))
        if getattr(self._choosing, "strict", False):
            options = replace(options, on_infeasible=OnInfeasible.RAISE)
        if (pin := getattr(self._choosing, "pin", None)) is not None:
            options = pin.applied_to(options)
        if getattr(self._choosing, "unfused_prices", False):
            options = replace(options, fused_prices=False, fused_memory=False)
        elif getattr(self._choosing, "unfused_memory", False):
            options = replace(options, fused_memory=False)
        asked = getattr(self._fitting, "asked", None)
        if getattr(self._fitting, "seen", None) is None:
            return options
        longer = getattr(self._choosing, "search_longer", False) and asked is None  # the last try's first plan
        fitted = replace(options, on_infeasible=OnInfeasible.RAISE, search_before_refusing=longer)
        # A re-asked candidate's refusal only moves the fit's bracket: its minimum is not probed.
        return fitted if asked is None else replace(fitted, budget=Budget(nbytes=asked), budget_kind=BudgetKind.PEAK,
                                                    probe_minimum=False)

    def _partition(self, joint: JointGraph) -> tuple[fx.GraphModule, fx.GraphModule]:
        try:
            planned = plan_joint_graph(joint, self._options_now())
        except solvers.BudgetInfeasibleError as error:
            error.args = (f"{error.args[0]} (graph {len(self.plans) + 1} compiled by this backend, covering "
                          f"{_describe_joint(joint)}). To plan such a piece at its own minimum instead, pass "
                          f"on_infeasible='clamp'.",)
            if joint.identity is not None and self.options.plan_cache is not None:
                self.options.plan_cache.put_compiled(joint.identity, Refusal.of(error))
            raise
        if joint.identity is not None and self.options.plan_cache is not None:
            self.options.plan_cache.put_compiled(joint.identity, planned.plan)
        self._planned(planned.plan)
        return planned.forward, planned.backward

    def _planned(self, plan: Plan) -> None:
        """Take ``plan`` as the plan of the compile in progress: a fitting attempt's candidate
        (``SamePlan`` if it was measured already), else one of ``plans``."""
        if getattr(self._fitting, "seen", None) is None:
            self._record(plan)
            return
        if plan_identity(plan) in self._fitting.seen:
            raise SamePlan(plan_identity(plan))
        self._fitting.made.append(plan)

    def compiled_identity(self, graph: str) -> str | None:
        """The identity torch's caches keep a compile of the graph ``graph`` under
        (``capture.cached_compile``): the graph and every planning input in force now (a
        fitting attempt's budget included); None, so never answered by a cache, without a plan
        cache to keep its plan beside it."""
        if self.options.plan_cache is None:
            return None
        identity = compiled_key(graph, self._options_now())
        renewed = self.options.plan_cache.get_compiled(identity, count=False)
        return renewed.identity if isinstance(renewed, Renewed) else identity

    def renew_identity(self, identity: str) -> str:
        """A new identity for ``identity`` (a nonce: a renewed one may be lost again), kept under it."""
        renewed = hashlib.sha256(f"{identity} renewed {uuid.uuid4()}".encode()).hexdigest()
        if self.options.plan_cache is not None:
            self.options.plan_cache.put_compiled(identity, Renewed(renewed))
        return renewed

    def reuse_compiled(self, identity: str) -> bool:
        """torch's caches answered a compile without planning: its stored plan is this compile's."""
        plan = None if self.options.plan_cache is None else self.options.plan_cache.get_compiled(identity)
        if isinstance(plan, Unplanned):
            return True
        if not isinstance(plan, Plan):
            return False
        self._planned(plan)
        self._fitting.answered = True
        return True

    def remember_unplanned(self, identity: str) -> None:
        """A compile with nothing to plan: its cache hit will need no plan."""
        if self.options.plan_cache is not None:
            self.options.plan_cache.put_compiled(identity, Unplanned())

    def refuse_as_before(self, identity: str) -> None:
        """A compile refused before (``BudgetInfeasibleError``) is refused again, before any tracing."""
        found = None if self.options.plan_cache is None else self.options.plan_cache.get_compiled(identity, count=False)
        if isinstance(found, Refusal):
            logger.info("compile %s was refused before with these settings; refused again without planning",
                        identity[:12])
            raise found.error()

    def _record(self, plan: Plan) -> None:
        with self._lock:
            self.plans.append(plan)
        if self._on_plan is not None:
            self._on_plan(plan)

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        if getattr(self._step, "beside", None) is None:
            self._warn_of_pieces()
        return self._compile_graph(gm, example_inputs)

    def _warn_of_pieces(self) -> None:
        """Outside ``optimize`` nothing says which graphs run in one step: say once what a peak budget
        then bounds, at a graph of a frame not compiled before (a graph break's resume, another
        function); a recompile of a frame (new shapes, eval) runs instead of its graph, not beside it."""
        frame = compiling_frame()
        recompiled = frame is not None and frame in self._frames
        if frame is not None:
            self._frames.add(frame)
        if recompiled or self._warned_of_pieces or not self.plans or not bounds_the_step_peak(self.options):
            return
        self._warned_of_pieces = True
        logger.warning("graph %d: the peak budget bounds each graph this backend compiles on its own; where graphs "
                       "run in one step (graph breaks, blocks compiled apart) the tensors the earlier ones save for "
                       "backward add to a later one's peak. remat_pass.optimize(model, budget, fullgraph=False) plans "
                       "each piece within what the earlier pieces leave; TORCH_LOGS=graph_breaks shows the breaks",
                       len(self.plans) + 1)

    def _compile_graph(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        with phase(f"capturing and planning graph {len(self.plans) + 1}", f"captured and planned graph "
                   f"{len(self.plans) + 1}"), older_objects_frozen(), program_stored_as_returned(gm) as settle:
            if self.fits_compiled_peak:
                return settle(self._compile_fitted(gm, example_inputs))
            if not (self._chunk_when_infeasible and chunkable(gm)):
                return settle(self._compile(gm, example_inputs))
            return settle(self._whole_or_chunked(gm, example_inputs, self.inner))

    def _whole_or_chunked(self, gm: fx.GraphModule, example_inputs: list[Any], inner: str) -> Any:
        """``chunk_loss=None``: the loss whole or chunked, by ``loss_choice.choose_loss``, each
        candidate compiled (and planned) strictly; the ones not kept are dropped from ``plans``.
        When none fits and the options say "clamp", the lowest-floor candidate is clamped."""
        def attempt(chunking: ChunkLoss | None, pin: Pin | None) -> tuple[Any, Plan, int] | None:
            if chunking is not None and not would_split(gm, chunking):
                return None
            compiled = self._compile_candidate(gm, example_inputs, inner, chunking, pin, strict=True)
            return compiled, self.plans[-1], 0 if chunking is None else chunking_extra_flops(gm, chunking)

        def discard(made: tuple[Any, Plan, int]) -> None:
            with self._lock:
                self.plans.remove(made[1])

        try:
            return choose_loss(attempt, lambda made: made[1], lambda made: made[2], discard)[0]
        except solvers.BudgetInfeasibleError as error:
            if OnInfeasible(self.options.on_infeasible) is not OnInfeasible.CLAMP:
                raise
            lowest = chunk_for_budget(error.budget_bytes, LossGradients.RECOMPUTED)
            if not would_split(gm, lowest):
                return self._compile_candidate(gm, example_inputs, inner, None, None, strict=False)
            return self._compile_candidate(gm, example_inputs, inner, lowest, Pin(error.budget_bytes, error.kind),
                                           strict=False)

    def _compile_candidate(self, gm: fx.GraphModule, example_inputs: list[Any], inner: str,
                           chunking: ChunkLoss | None, pin: Pin | None, *, strict: bool) -> Any:
        """``gm`` compiled by ``inner`` with its loss whole or chunked, planned under ``pin`` (else
        the user's budget), refused rather than clamped when ``strict``."""
        compile_ = make_dynamo_backend(self._partition, inner, chunking, self)
        self._choosing.pin, self._choosing.strict = pin, strict
        try:
            return compile_(gm, example_inputs)
        finally:
            self._choosing.pin, self._choosing.strict = None, False

    def __repr__(self) -> str:
        per_piece = f", pieces={self.pieces}" if self.pieces > 1 else ""
        return (f"RematBackend(budget={self.options.budget}{per_piece}, inner={self.inner!r}, "
                f"solver={self.options.solver!r}, on_infeasible='{self.options.on_infeasible}')")


def _describe_joint(joint: JointGraph) -> str:
    """The modules a joint graph's forward covers, to name it in an error."""
    modules = [module_path(node) for node in joint.module.graph.nodes if node.op == "call_function"]
    return describe_piece([m for m in modules if m])


def _per_piece(budget: Budget, kind: str, pieces: int) -> tuple[Budget, str]:
    """The budget of one of ``pieces`` graphs that share a step budget (see RematBackend)."""
    if not isinstance(pieces, int) or isinstance(pieces, bool) or pieces < 1:
        raise ValueError(f"pieces must be a positive int, got {pieces!r}")
    if pieces == 1 or budget.fraction is not None:
        return budget, kind
    if kind == BudgetKind.PEAK:
        raise ValueError(
            f"a peak budget cannot be split over {pieces} pieces: the step's peak is not the sum of the pieces' "
            "peaks. Give each piece its own peak budget (pieces=1), or split a saved-bytes budget."
        )
    assert budget.nbytes is not None
    share = max(budget.nbytes // pieces, 1)
    logger.info("a step budget of %d bytes saved for backward, split over %d pieces: %d bytes each",
                budget.nbytes, pieces, share)
    return Budget(nbytes=share), BudgetKind.SAVED


def backend(budget: object = DEFAULT_BUDGET, *, inner: str | None = None, **options: Any) -> RematBackend:
    """A ``torch.compile`` backend with a budget; its graphs compiled by Inductor unless
    ``inner="eager"`` (see ``BACKEND_INNER``).

    >>> import torch, remat_pass
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    >>> compiled = torch.compile(model, backend=remat_pass.backend(budget=0.5))
    >>> compiled(torch.randn(2, 8)).sum().backward()
    """
    return RematBackend(budget, inner=inner, **options)


def remat_backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
    """The registered "remat" backend: settings from the environment (``REMAT_PASS_BUDGET``,
    ``REMAT_PASS_BUDGET_KIND``, ``REMAT_PASS_ON_INFEASIBLE``, ``REMAT_PASS_INNER``,
    ``REMAT_PASS_PLAN_CACHE``; see the module docstring), by default ``DEFAULT_BUDGET`` clamped where
    a graph cannot meet it, on Inductor."""
    return RematBackend(**settings_from_environment())(gm, example_inputs)


def settings_from_environment(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The registered backend's keyword arguments from ``REMAT_PASS_*`` (bad values raise, naming the variable)."""
    env = os.environ if environ is None else environ
    budget: object = DEFAULT_BUDGET
    text = env.get(ENV_BUDGET, "").strip()
    if text:
        try:
            budget = float(text) if "." in text and text.replace(".", "", 1).isdigit() else text
            parse_budget(budget)
        except InvalidBudgetError as error:
            raise InvalidBudgetError(f"{ENV_BUDGET}={text!r}: {error}") from None
    kind = env.get(ENV_BUDGET_KIND, BudgetKind.AUTO).strip() or BudgetKind.AUTO
    on_infeasible = env.get(ENV_ON_INFEASIBLE, OnInfeasible.CLAMP).strip() or OnInfeasible.CLAMP
    inner = env.get(ENV_INNER, "").strip() or None
    for name, value, allowed in ((ENV_BUDGET_KIND, kind, BudgetKind), (ENV_ON_INFEASIBLE, on_infeasible, OnInfeasible)):
        if value not in {member.value for member in allowed}:
            raise ValueError(f"{name}={value!r}: must be one of {', '.join(member.value for member in allowed)}")
    if inner is not None and inner not in INNER_COMPILERS:
        raise ValueError(f"{ENV_INNER}={inner!r}: must be one of {', '.join(INNER_COMPILERS)}")
    plan_cache = plan_cache_from_text(env.get(ENV_PLAN_CACHE, ""))
    return {"budget": budget, "budget_kind": kind, "on_infeasible": on_infeasible, "inner": inner,
            "plan_cache": plan_cache}
