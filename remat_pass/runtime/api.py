"""Stage 5: ``optimize(model, budget)`` — a module that trains like ``model`` with less memory.

The returned module shares the original's parameters and buffers (nothing is copied, the
original is not modified) and runs its forward through the "remat" dynamo backend with
``fullgraph=True`` (one graph, or a clear error) and ``dynamic=False`` (every new input
signature is captured and planned again, so a plan is never reused for shapes it was not made
for). Plans are recorded per ``plan_keys.PlanKey`` (inputs, train/eval, and every parameter's
shape, dtype, device and requires_grad: what selects the compiled graph), each as the plan the
call actually ran; every new plan is logged at INFO with its reason.

It stands in for the model: attributes it does not have itself (``config``, ``generate``,
``save_pretrained``, ``device``, ...) are the model's, ``forward`` has the model's signature (what
Hugging Face's Trainer inspects), and it pickles and deep-copies (compiled state is dropped and
rebuilt; the copy plans again on its first call).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from remat_pass import solvers
from remat_pass.solvers.problem import Plan

from ..capture.capture import capture_failure
from ..capture.capture_errors import CaptureCause, diagnose
from ..compat import (caching_precompile, capture_config, inductor_cache_dir, recompile_limit,
                      recompile_limit_errors)
from ..annotate.costs import CostModel, DeviceProfile, model_profile
from .distributed import reject_wrapped_model
from .dynamo_backend import RematBackend
from .graph_breaks import ran_without_a_graph, warn_graph_breaks, with_fullgraph_hint
from .earlier_pieces import Lowest, PieceShares, Refused, bounds_the_step_peak, explain_refusal
from ..errors import CaptureError, RematError
from ..capture.frozen_objects import older_objects_frozen
from ..capture.inputs import call_inputs, canonical, forward_signature
from ..planning.pipeline import DEFAULT_BUDGET
from .plan_cache import as_plan_cache
from .precompiled_plans import plans_compiled_elsewhere, record_plans
from .weak_owner import OwnerBackend, compile_apart, slot_runner
from .plan_keys import PlanKey, plan_key, replan_reason
from ..capture.state import untouched, untouched_on_error

logger = logging.getLogger(__name__)

_RECOMPILE_LIMIT_HIT = recompile_limit_errors()  # absent in older torch: then nothing matches


@dataclass(frozen=True)
class _Settings:
    """How plans are made: all a copy or an unpickled module needs to build its own backend."""

    budget: object
    inner: str
    solver: str
    device: str | DeviceProfile
    time_limit: float | None
    budget_kind: str
    offload: bool = False
    host_budget: object = None
    solver_options: Mapping[str, Any] = field(default_factory=dict)
    fullgraph: bool = True  # False: graph breaks allowed, each piece planned on its own
    dynamic: bool = False  # True: one plan, made at the first call's sizes, for every size
    plan_cache: Any = True  # plan_cache.PlanCache, a directory, True (the default one), False or None (none)
    costs: str = CostModel.ROOFLINE  # how recompute is priced: roofline, flops or measure
    prove: bool | None = None  # the proof work (effort.planning_effort); None: only with a time_limit


# Per-instance state that is rebuilt, never copied or pickled: it holds a lock, compiled code and
# plans for graphs that a copy has not compiled.
_TRANSIENT = ("_backend", "_compiled", "_plans", "_key_of", "_last_ran", "_calls", "_signature", "forward",
              "_warmed_up", "_slots")


class RematModule(nn.Module):
    """What ``optimize`` returns. Call it like the original; ``.plan`` is the plan in use.

    ``state_dict``/``load_state_dict`` are the original module's (same keys), so checkpoints
    move freely between the two.
    """

    def __init__(
        self,
        module: nn.Module,
        budget: object,
        *,
        inner: str,
        solver: str,
        device: str | DeviceProfile,
        time_limit: float | None,
        budget_kind: str = "auto",
        offload: bool = False,
        host_budget: object = None,
        fullgraph: bool = True,
        dynamic: bool = False,
        plan_cache: Any = True,
        costs: str = CostModel.ROOFLINE,
        prove: bool | None = None,
        **solver_options: Any,
    ) -> None:
        super().__init__()
        self.module = module
        self._shares = PieceShares()  # the pieces' lowest peaks, learnt from refusals: kept across rebuilds
        self._settings = _Settings(budget, inner, solver, device, time_limit, budget_kind, offload, host_budget,
                                   dict(solver_options), fullgraph, dynamic, as_plan_cache(plan_cache), costs, prove)
        self._build()

    def _build(self) -> None:
        """Fresh compiled state: a backend, a compiled forward, no plans."""
        settings = self._settings
        self._plans: dict[PlanKey, Plan] = {}
        self._key_of: dict[int, PlanKey] = {}  # id(plan) -> the key of the call it was made for
        self._last_ran: tuple[Plan, ...] = ()  # the plans of the graph pieces the last call ran
        self._calls = threading.local()  # .ran: the plans of the graphs this thread's call ran; .refused: a piece refused
        self._warmed_up = False  # one no_grad warm-up forward ran for a first-call lock or hooks
        self._asked_precompile = False  # a call ran no plan of ours (a precompiled step): its record read
        self._backend = RematBackend(
            settings.budget, inner=settings.inner, solver=settings.solver, device=settings.device,
            time_limit=settings.time_limit, budget_kind=settings.budget_kind, free_inputs=settings.fullgraph,
            offload=settings.offload, host_budget=settings.host_budget, plan_cache=settings.plan_cache,
            costs=settings.costs, prove=settings.prove, **settings.solver_options,
        )
        self._signature = forward_signature(self.module.forward)
        # Not a registered submodule: its parameters are the original's.
        self._slots: list[_Slot] = []  # each graph dynamo compiled, run through ``weak_owner.slot_runner``
        object.__setattr__(self, "_compiled", compile_apart(self.module, OwnerBackend(self),
                                                            fullgraph=settings.fullgraph, dynamic=settings.dynamic))
        # The model's signature on forward, as torch.compile's own wrapper does: tools that inspect
        # forward (Trainer drops batch columns forward does not name) see the model's parameters.
        self.forward = functools.update_wrapper(functools.partial(RematModule._forward, self), self.module.forward)

    def _compile_graph(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        """The backend, plus a note of which plans each run of the compiled graph uses. Where the
        pieces' lowest peaks learnt since change what a peak budget leaves this graph
        (``earlier_pieces``), it is planned and compiled again at its next run, from that run's inputs."""
        piece = self._compile_piece(gm, example_inputs)
        self._slots.append(_Slot(gm, piece))
        return slot_runner(self, len(self._slots) - 1, piece.compiled)  # dynamo keeps it: holds self weakly

    def _run_slot(self, index: int, args: tuple[Any, ...]) -> Any:
        slot, calls = self._slots[index], self._calls
        if slot.piece.learnt != len(self._shares.lowest):
            slot.piece = self._compile_piece(slot.gm, list(args))
        calls.ran = getattr(calls, "ran", ()) + slot.piece.plans  # each piece of a call between graph breaks
        calls.graphs = getattr(calls, "graphs", 0) + 1
        return slot.piece.compiled(*args)

    def _compile_piece(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> _CompiledPiece:
        """``gm`` compiled by the backend beside the graphs this call ran before it (dynamo runs each
        piece between graph breaks before it compiles the next): under a peak budget those are the
        earlier pieces of the step."""
        first = len(self._backend.plans)
        calls = self._calls
        earlier = getattr(calls, "ran", ())
        beside = self._shares.beside(len(earlier), earlier)
        learnt = len(self._shares.lowest)
        try:
            with self._backend.beside_other_pieces(beside):
                compiled = self._backend(gm, example_inputs)
        except solvers.BudgetInfeasibleError as error:
            calls.refused = Refused(beside, Lowest.of(error))
            explain_refusal(error, self._backend.options, beside, self._shares)
            raise
        plans = tuple(self._backend.plans[first:])
        if caching_precompile():  # a restart may run this step without us: say what it was planned under
            record_plans(self._settings.plan_cache, self.module, self._backend.options, plans)
        return _CompiledPiece(compiled, plans, learnt)

    @property
    def plan(self) -> Plan | None:
        """The plan the most recent training call ran (None before the first one)."""
        return self._last_ran[-1] if self._last_ran else None

    @property
    def plans(self) -> dict[PlanKey, Plan]:
        """The plan each key (inputs, mode, parameter states) last ran with."""
        return dict(self._plans)

    @property
    def pieces(self) -> tuple[Plan, ...]:
        """The plans of every graph piece the most recent training call ran, in order (with
        ``fullgraph=False``, one per piece between graph breaks; ``plan`` is the last)."""
        return self._last_ran

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)  # no backward, nothing to plan
        args, kwargs = canonical(self._signature, args, kwargs)
        made_before = len(self._backend.plans)
        self._calls.ran, self._calls.refused, self._calls.graphs = (), None, 0
        output = self._run_sharing_the_peak(args, kwargs)
        ran = self._calls.ran
        if not self._calls.graphs and not caching_precompile():
            ran_without_a_graph(type(self.module).__name__)
        if not ran and not self._last_ran and not self._asked_precompile and caching_precompile():
            self._asked_precompile = True  # the step came from torch's precompile: remat_pass was not called
            ran = plans_compiled_elsewhere(self._settings.plan_cache, self.module, self._backend.options)
        if len(self._backend.plans) > made_before:
            self._key_new_plans(ran, args, kwargs)
        if ran:
            key = self._key_of.get(id(ran[-1]))
            if key is not None:
                self._plans[key] = ran[-1]
            object.__setattr__(self, "_last_ran", ran)  # per call: skip nn.Module's registry checks
        return output

    def _key_new_plans(self, ran: tuple[Plan, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Key the plans this call made and log why they were made. A compiled graph is chosen by
        guards that cover everything in the key, so a plan is keyed once, when it is made: a call
        that reuses graphs pays nothing for the key (a 291-parameter Llama: 2.6 ms; binding the
        call to forward's signature, which every call does, costs 22 us). With ``dynamic=True``
        one plan serves many shapes and stays under the key of the call it was made for."""
        key = plan_key(self.module, args, kwargs)
        previous = self._key_of.get(id(self._last_ran[-1])) if self._last_ran else None
        for plan in ran:
            self._key_of.setdefault(id(plan), key)
        logger.info("%s: new plan (%d made so far): %s", type(self.module).__name__,
                    len(self._backend.plans), replan_reason(previous, key, self.module))
        if len(ran) > 1:
            warn_graph_breaks(self._settings.budget, self._settings.budget_kind, len(ran))

    def _run_sharing_the_peak(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The call; where it is the first and a later piece of the step was refused beside what the
        earlier pieces keep (an absolute peak budget over a step split at graph breaks), the call
        again from the same buffers and random-number state, every piece planned anew with that
        piece's lowest peak reserved (``earlier_pieces``)."""
        if self._backend.plans or not bounds_the_step_peak(self._backend.options):
            return self._run_compiled(args, kwargs)
        while True:
            try:
                with untouched_on_error(self.module, (args, kwargs), (solvers.BudgetInfeasibleError,)):
                    return self._run_compiled(args, kwargs)
            except solvers.BudgetInfeasibleError:
                refused = self._calls.refused
                if not self._shares.learn(refused, self._backend.options.budget.nbytes or 0):
                    raise
            logger.warning("piece %d of the step was refused beside the %d bytes the earlier pieces keep: planning "
                           "the step again, %d bytes (its lowest peak) reserved for it", refused.beside.index + 1,
                           refused.beside.held, refused.lowest.peak)
            self._calls.ran, self._calls.refused, self._calls.graphs = (), None, 0

    def _run_compiled(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            return self._call_compiled(args, kwargs)
        except CaptureError as error:
            if not _is_first_call_setup(error) or self._warmed_up:
                raise
        # Hugging Face models install their output-capturing hooks (under a threading lock) on the
        # first forward that asks for them, which dynamo cannot trace; one forward without grad
        # installs them. Safe: buffers and RNG state are restored, nothing is recorded for backward.
        self._warmed_up = True
        logger.warning("%s: forward enters a lock or registers hooks, which dynamo cannot trace (Hugging Face "
                       "models install hooks on their first call): ran one warm-up forward under no_grad "
                       "(buffers and RNG state restored) and capturing again", type(self.module).__name__)
        with untouched(self.module, (args, kwargs)), torch.no_grad():
            self.module(*args, **kwargs)
        return self._call_compiled(args, kwargs)

    def _call_compiled(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            with capture_config():
                return self._compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            cause = getattr(error, "inner_exception", None) or error.__cause__
            if isinstance(cause, RematError):
                raise cause.with_traceback(cause.__traceback__) from None
            raise backend_failure(cause) from error
        except torch._dynamo.exc.TorchDynamoException as error:
            raise with_fullgraph_hint(capture_failure(error), self._settings.fullgraph) from error
        except AssertionError as error:  # torch's precompile fails some steps with a bare assertion
            if caching_precompile() and diagnose(error).cause is CaptureCause.PRECOMPILE:
                raise capture_failure(error) from error
            raise
        except _RECOMPILE_LIMIT_HIT as error:  # not a TorchDynamoException
            limit = recompile_limit()
            raise CaptureError(
                f"dynamo's recompile limit for this forward ({limit}, torch._dynamo.config.recompile_limit) is "
                f"reached: every new input signature (shapes, dtypes, train/eval) is captured and planned again "
                f"(this module has {len(self._plans)} plans), and so is every change of Python state forward "
                f"reads, such as an int attribute it increments (`self.calls += 1`: dynamo specializes on the "
                f"value). Pad or bucket inputs to a few shapes, keep changing state in a tensor buffer, or raise "
                f"torch._dynamo.config.recompile_limit. TORCH_LOGS=recompiles shows why each recompile happened."
            ) from error

    def plan_ahead(self, *args: Any, **kwargs: Any) -> Plan | None:
        """Capture and plan for this call now (``plan_ahead(tokens)``, ``plan_ahead(**batch)``),
        leaving buffers and RNG state as they were. The first training call with inputs like
        these runs this plan: nothing is captured again."""
        with untouched(self.module, (args, kwargs)), torch.enable_grad(), older_objects_frozen():
            self(*args, **kwargs)
        return self.plan

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):  # type: ignore[override]
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getattr__(self, name: str) -> Any:
        """nn.Module's lookup (parameters, buffers, submodules), then the wrapped model's attributes."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__") or name in _TRANSIENT:
                raise
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(
                f"'{type(self).__name__}' (wrapping {type(module).__name__}) has no attribute {name!r}"
            ) from None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for name in _TRANSIENT:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._build()

    def extra_repr(self) -> str:
        return repr(self._backend)


@dataclass(frozen=True)
class _CompiledPiece:
    """One graph as compiled: the callable, the plans it runs, and how many of the pieces' lowest
    peaks were known when it was planned (``earlier_pieces.PieceShares``)."""

    compiled: Any
    plans: tuple[Plan, ...]
    learnt: int


@dataclass
class _Slot:
    """A graph dynamo compiled and the piece it runs now (replaced when it is planned again)."""

    gm: torch.fx.GraphModule
    piece: _CompiledPiece


# What a model does once, on its first call, that dynamo cannot trace; a warm-up forward does it.
_FIRST_CALL_SETUP = frozenset({CaptureCause.LOCK, CaptureCause.HOOK_INSTALL})


def raised_in_inductor(error: BaseException | None) -> bool:
    """Whether ``error`` came from Inductor (its code generation, its C++ compile, its on-disk
    cache): a frame of ``torch._inductor`` below remat_pass's innermost frame. Inductor calls our
    partitioner, so an error raised in remat_pass's own code has Inductor frames above it only."""
    frames = traceback.extract_tb(error.__traceback__) if error is not None else []
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    inductor = os.path.join(os.path.dirname(torch.__file__), "_inductor")
    below = max((i for i, frame in enumerate(frames) if frame.filename.startswith(ours)), default=-1) + 1
    return any(frame.filename.startswith(inductor) for frame in frames[below:])


def backend_failure(cause: BaseException | None) -> RematError:
    """The error for a graph compile that failed outside remat_pass's own checks: Inductor's, with
    what usually causes it and the way around it; anything else, a remat_pass bug to report."""
    what = f"{type(cause).__name__}: {cause}"
    if raised_in_inductor(cause):
        return RematError(
            f"Inductor failed compiling the rewritten graphs: {what}. If it names a file in Inductor's "
            f"on-disk cache ({inductor_cache_dir()}), another process may have written that file at the same "
            "time: run again, or give each process its own TORCHINDUCTOR_CACHE_DIR. inner='eager' runs the "
            "graphs without Inductor.")
    return RematError(f"planning or rewriting the captured graph failed: {what}. This is a remat_pass bug; "
                      "please report it with the model.")


def _is_first_call_setup(error: CaptureError) -> bool:
    diagnosis = getattr(error, "diagnosis", None)
    return diagnosis is not None and diagnosis.cause in _FIRST_CALL_SETUP


def optimize(
    model: nn.Module,
    budget: object = DEFAULT_BUDGET,
    *,
    example_inputs: Any = None,
    example_kwargs: Mapping[str, Any] | None = None,
    inner: str = "eager",
    solver: str = "ilp",
    device: str | DeviceProfile = "auto",
    time_limit: float | None = None,
    prove: bool | None = None,
    budget_kind: str = "auto",
    offload: bool = False,
    host_budget: object = None,
    fullgraph: bool = True,
    dynamic: bool = False,
    plan_cache: Any = True,
    costs: str = CostModel.ROOFLINE,
    chunk_loss: Any = None,
    **solver_options: Any,
) -> RematModule:
    """Wrap ``model`` so that its training step keeps at most ``budget`` activation bytes.

    budget: a float in (0, 1] is a fraction of what the un-rematerialized step saves for
    backward; an int (bytes) or a string like "512MB" / "2GiB" is an absolute cap on the peak
    activation memory of the step. ``budget_kind`` ("saved" or "peak") overrides that choice
    (a peak fraction is relative to the un-rematerialized step's peak). The plan is made on the
    first call, or now from ``example_inputs`` (a tuple of positional inputs, one tensor, or a
    dict of keyword inputs such as a Hugging Face batch) and ``example_kwargs`` (keyword inputs
    beside positional ones); the first training call then runs that plan. An impossible budget raises
    BudgetInfeasibleError with the smallest feasible one. ``device`` says where the step runs:
    "auto" (the device of its tensors), a name ("cpu", "a100", "h100", "h200") or a
    ``costs.DeviceProfile``. ``costs`` says how recompute is priced: "roofline" (the device's
    profile), "flops" (recomputed FLOPs alone, like torch's knapsack; ``device="flops"`` is an
    alias) or "measure" (each forward op timed once on the device with the first call's real
    inputs, before planning; see ``remat_pass.annotate.op_timing``).

    By default planning is fast: at most ``effort.FAST_TIME_LIMIT`` (2 s) per graph, spent on
    finding a good plan, with no proof work; the plan's ``gap`` is what its searches proved
    (``plan.status`` is "optimal" only when proven). ``time_limit`` (seconds) asks for more: up to
    that long, the proof work included (the peak planner's exact rows and, when its own bound
    leaves the answer open, the lower bound for any schedule, ``solvers.peak.schedule_bound``);
    ``prove=True`` alone does the same within 60 s, ``prove=False`` keeps a longer limit free of
    it. Capture and annotation come on top. Under a peak budget the peak planner answers within the
    limit when a plan fits: its searches get the first four fifths (nine tenths without proof
    work), making cheaper plans that overshoot fit the next tenth, the bound the last. A model
    build or simulation already started is not interrupted, so a deep model may run a little past
    it. When nothing fits, the search without proof work goes on to ``effort.REFUSAL_TIME_LIMIT``
    (10 s) before it refuses the budget (not for the Inductor fit's candidates: a refusal there
    moves the fit to another budget), then a fixed probe of the trade-off curve follows, so that
    the smallest budget the error states is one a plan was found for. Measured at a 60 s limit:
    60.1-60.7 s on a 12- to 48-layer GPT, 4-60 s on 4-layer models; at 10 s, 8.9-9.0 s; by
    default, see ``benchmarks/SCALING.md`` ("Fast by default", "Two seconds by default").

    ``inner`` says which compiler runs the plan's two graphs: "eager" (the default) runs them op by
    op, the program the peak model describes exactly; "inductor" compiles them with Inductor, faster,
    and under a peak budget fits the plan to the compiled program by measurement (candidate plans
    compiled and their steps measured on the first call's inputs, up to ``inductor_fit.ATTEMPTS``
    compiles; ``remat_pass.runtime.inductor_fit``), raising BudgetInfeasibleError with the lowest
    measured peak when none fits. The ``torch.compile`` backend defaults to Inductor instead.

    ``offload=True`` lets the planner also send saved activations to host memory over the
    device's host link where the transfer hides behind compute (``device`` must have one, e.g.
    "h100"; ``host_budget`` bounds the host bytes). On CUDA the step uses PyTorch's
    ``torch.ops.ao`` offload ops; on the CPU a copy stands in for the transfer, so a model on
    the CPU can be planned for an H100 and checked against eager.

    ``fullgraph=False`` accepts graph breaks: each piece is planned on its own (a fraction applies
    to each piece; an absolute budget bounds each piece separately); ``.pieces`` lists their plans.
    ``dynamic=True`` makes one plan, at the first call's shapes, that serves every input size
    (the budget is checked at that shape; plan ahead with the largest one). ``plan_cache`` stores plans on
    disk, keyed by the graph as planned and every planning input, so a new ``RematModule``, a
    recompile or a restarted job planning the same graph skips the solve: by default in
    ``~/.cache/remat_pass/plans``; a directory or ``plan_cache.PlanCache`` to choose, ``False`` for none.

    ``chunk_loss`` computes a language-model loss (a linear head, row-wise ops, ``F.cross_entropy``)
    in chunks of tokens, each chunk's logits recomputed in backward, so the ``tokens x vocab``
    logits are never whole (``capture.loss_chunking``): None (default) when the budget cannot be
    met otherwise, True always, False never, or a ``ChunkLoss`` (chunk size in bytes).

    >>> import remat_pass
    >>> from remat_pass.examples import gpt_example, lm_loss
    >>> model, tokens, targets = gpt_example()
    >>> opt = remat_pass.optimize(model, budget=0.4)
    >>> lm_loss(opt(tokens), targets).backward()
    >>> opt.plan.kept_bytes <= 0.4 * opt.plan.keep_all_bytes
    True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize expects an nn.Module, got {type(model).__name__}")
    reject_wrapped_model(model)
    device = model_profile(device, model)
    optimized = RematModule(
        model, budget, inner=inner, solver=solver, device=device, time_limit=time_limit, prove=prove,
        budget_kind=budget_kind, offload=offload, host_budget=host_budget, fullgraph=fullgraph, dynamic=dynamic,
        plan_cache=plan_cache, costs=costs, chunk_loss=chunk_loss, **solver_options,
    )
    if example_inputs is not None or example_kwargs is not None:
        call = call_inputs(example_inputs, example_kwargs)
        optimized.plan_ahead(*call.args, **call.kwargs)
    return optimized
