"""Plan a model's training step without running it: ``remat_pass.plan(model, inputs, budget=...)``.

The step is traced once (``pipeline.trace_step``: capture, annotate, graph pieces merged into one
problem) and solved; nothing is trained, and the model comes back as it was. A model too big for
this machine can be planned from the meta device: its parameters, buffers and inputs are swapped
for fake CPU tensors (``FakeTensorMode``: shapes and dtypes, no storage) for the trace, so a
Llama-2-70B step is planned in a few GB of RAM. Tensors made inside ``FakeTensorMode`` by the
caller work the same way.

What a fake-CPU trace sees is what the CPU kernels would run: ``scaled_dot_product_attention``
becomes the CPU flash-attention kernel (output and log-sum-exp saved, no ``s x s`` scores: the
same memory profile as FlashAttention on a GPU), and in fp32 a dropout output can be rebuilt from
its mask (on CUDA it is kept instead; for bf16/fp16 models the two agree).

>>> import torch, remat_pass
>>> from remat_pass.examples import GPT, GPTConfig
>>> with torch.device("meta"):
...     model = GPT(GPTConfig(layers=2, hidden=64, heads=2, seq_len=32, vocab_size=128))
>>> tokens = torch.zeros(2, 32, dtype=torch.long, device="meta")
>>> plan = remat_pass.plan(model, (tokens,), budget=0.5)
>>> plan.kept_bytes <= 0.5 * plan.keep_all_bytes, next(model.parameters()).device.type
(True, 'meta')
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, Mapping, TypeVar

import torch
from torch import nn

from remat_pass import solvers
from remat_pass.solvers.problem import Plan

from .budget import parse_budget
from ..compat import fake_tensor_mode, is_fake
from ..annotate.costs import CostModel, DeviceProfile, parse_costs
from ..capture.inputs import call_inputs
from ..capture.loss_chunking import ChunkLoss, as_chunk_loss
from ..rewrite.offload import check_offload_options, parse_host_budget
from ..runtime.plan_cache import as_plan_cache
from .pipeline import (
    DEFAULT_BUDGET,
    BudgetKind,
    LossFn,
    PlanOptions,
    TracedStep,
    plan_problem,
    resolve_budget_kind,
)
from .effort import planning_effort
from .loss_choice import Pin, choose_loss
from .repeated_blocks import trace_repeated
from .trace_key import before_tracing
from ..tools.report import PlanReport, block_depth

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Why plan() differs from optimize/explain/sweep (device "cpu", solver "ilp"): those trace and run
# the step on this machine, where the CPU cost model describes what runs and the graphs are small
# enough for the exact ILP. plan() exists to plan a step too big to run here (meta tensors) for the
# accelerator it will train on: a GPU cost model, and the fast planner, which scales to 80-layer
# models where the ILP takes minutes.
PLAN_DEVICE = "h100"
PLAN_SOLVER = "fast"


def plan(
    model: nn.Module,
    example_inputs: Any,
    budget: object = DEFAULT_BUDGET,
    *,
    device: str | DeviceProfile = PLAN_DEVICE,
    solver: str = PLAN_SOLVER,
    budget_kind: str = BudgetKind.AUTO,
    loss_fn: LossFn | None = None,
    time_limit: float | None = None,
    prove: bool | None = None,
    verbose: bool = False,
    depth: int | None = None,
    offload: bool = False,
    host_budget: object = None,
    example_kwargs: Mapping[str, Any] | None = None,
    costs: str = CostModel.ROOFLINE,
    plan_cache: Any = True,
    chunk_loss: Any = None,
    pretrace_key: bool = True,
    **solver_options: Any,
) -> Plan:
    """Decide what ``model``'s training step keeps and recomputes under ``budget``; run nothing.

    ``budget`` as for ``optimize`` (a fraction of the saved bytes, or an absolute size; see
    ``budget_kind``). ``device`` picks the cost model ("cpu", "a100", "h100", "h200") and ``costs``
    how it prices recompute ("roofline", "flops"; "measure" needs real tensors), ``solver``
    any name in ``solvers.SOLVERS`` ("fast" scales to deep models; "ilp" is exact but slow there).
    Parameters, buffers and inputs on the meta device are traced as fake tensors, nothing is
    allocated; real tensors run one forward on their device. ``example_inputs`` as for
    ``optimize``: a tuple, one tensor, or a dict of keyword inputs (a Hugging Face batch), plus
    ``example_kwargs``. ``loss_fn(output, *args, **kwargs)`` makes the loss part of the planned step. ``verbose`` prints the report (``PlanReport.text``) per module at ``depth``.
    ``offload=True`` also lets saved values go to host memory (``optimize``'s option).
    ``time_limit`` and ``prove`` as for ``optimize``: by default 2 s of planning and no proof work;
    ``plan_cache`` too (by default ``~/.cache/remat_pass/plans``; ``False`` for none).
    ``chunk_loss`` as for ``optimize``: by default the loss is chunked when the budget cannot be
    met whole, or is met whole only with more work (``loss_choice.choose_loss``). A repeated call
    is answered from the plan cache before tracing, from a key over the model's structure, code,
    attributes and inputs and the global state a trace reads (``planning.trace_key``, which lists
    what that key cannot see, such as a module-level flag a forward reads); ``pretrace_key=False``
    always traces (the cache then skips the solve only).

    Raises BudgetInfeasibleError (with the smallest feasible budget) when nothing fits.
    """
    report_ = plan_with_report(model, example_inputs, budget, device=device, solver=solver, budget_kind=budget_kind,
                               loss_fn=loss_fn, time_limit=time_limit, prove=prove, offload=offload,
                               host_budget=host_budget,
                               example_kwargs=example_kwargs, costs=costs, plan_cache=plan_cache,
                               chunk_loss=chunk_loss, pretrace_key=pretrace_key, **solver_options)
    if verbose:
        print(report_.render(depth=depth))
    return report_.plan


def plan_with_report(
    model: nn.Module,
    example_inputs: Any,
    budget: object = DEFAULT_BUDGET,
    *,
    device: str | DeviceProfile = PLAN_DEVICE,
    solver: str = PLAN_SOLVER,
    budget_kind: str = BudgetKind.AUTO,
    loss_fn: LossFn | None = None,
    time_limit: float | None = None,
    prove: bool | None = None,
    offload: bool = False,
    host_budget: object = None,
    example_kwargs: Mapping[str, Any] | None = None,
    costs: str = CostModel.ROOFLINE,
    plan_cache: Any = True,
    chunk_loss: Any = None,
    pretrace_key: bool = True,
    **solver_options: Any,
) -> PlanReport:
    """``plan`` plus the step's FLOPs and forward time: a ``PlanReport`` at the blocks' depth."""
    solvers.get_solver(solver)  # an unknown name is a ValueError naming the choices, before tracing
    parsed = parse_budget(budget)
    resolve_budget_kind(parsed, budget_kind)  # reject a bad kind before tracing
    check_offload_options(offload, device, solver)
    parse_costs(costs)
    time_limit, prove = planning_effort(time_limit, prove)
    call = call_inputs(example_inputs, example_kwargs)

    def trace(chunking: ChunkLoss | None) -> TracedStep:
        with traceable(model, call.flat()) as flat:
            # Always through trace_step's loss wrapper: module paths then read as the model names
            # them, even when the model's forward is itself wrapped (Hugging Face decorators).
            args, kwargs = flat[:len(call.args)], dict(zip(call.kwargs, flat[len(call.args):]))
            # A stack of identical blocks is traced 4 blocks deep and stamped (repeated_blocks).
            return trace_repeated(model, args, loss_fn=loss_fn or _output, device=device, example_kwargs=kwargs,
                                  costs=costs, chunk_loss=chunking)

    options = PlanOptions(parsed, solver, device, time_limit, budget_kind, dict(solver_options), offload=offload,
                          host_budget_bytes=parse_host_budget(host_budget), prove=prove,
                          plan_cache=as_plan_cache(plan_cache))

    def report() -> PlanReport:
        traced, made = plan_or_chunk(trace, chunk_loss, lambda step, pin: plan_problem(
            step.problem, pin.applied_to(options) if pin else options).plan)
        return PlanReport(made, traced.step_flops, traced.forward_seconds, traced.pieces, budget=parsed,
                          depth=block_depth(made.problem))

    arguments = {"budget": parsed, "solver": solver, "device": device, "budget_kind": budget_kind, "loss_fn": loss_fn,
                 "time_limit": time_limit, "prove": prove, "offload": offload, "host_budget": options.host_budget_bytes,
                 "costs": costs, "chunk_loss": chunk_loss, "solver_options": solver_options}
    return before_tracing("plan", model, call, arguments, options.plan_cache if pretrace_key else None, report)


def plan_or_chunk(trace: Callable[[ChunkLoss | None], TracedStep], chunk_loss: Any,
                  plan_traced: Callable[[TracedStep, Pin | None], T], plan_of: Callable[[T], Plan] = lambda p: p,
                  ) -> tuple[TracedStep, T]:
    """Trace and plan the step. With ``chunk_loss=None``, by the training backend's rule
    (``loss_choice.choose_loss``), so that ``plan`` and ``explain`` say what ``optimize`` does:
    a chunked candidate is a second trace of the step, the loss chunked. ``plan_traced(traced,
    pin)`` plans one traced step, the budget pinned to ``pin`` when given; ``plan_of`` reads the
    ``Plan`` from what ``plan_traced`` returns."""
    traced = trace(as_chunk_loss(chunk_loss))
    if chunk_loss is not None:
        return traced, plan_traced(traced, None)

    def attempt(chunking: ChunkLoss | None, pin: Pin | None) -> tuple[TracedStep, T] | None:
        if chunking is None:
            return traced, plan_traced(traced, None)
        if not _may_split(traced, chunking):  # nothing to cut: do not pay a second capture to find out
            return None
        chunked = trace(chunking)
        return (chunked, plan_traced(chunked, pin)) if _splits(chunked) else None

    return choose_loss(attempt, lambda made: plan_of(made[1]),
                       lambda made: sum(region.extra_flops for region in made[0].chunked))


def _may_split(traced: TracedStep, chunking: ChunkLoss) -> bool:
    """Whether the step traced whole computes a cross-entropy (AOTAutograd's ``nll_loss_forward``,
    which every ``F.cross_entropy`` with class-index targets becomes; the only loss chunking
    rewrites) over log-probabilities larger than one chunk: otherwise chunking would leave it
    whole, and tracing the step again to find out costs a whole capture for nothing."""
    problem = traced.problem
    smallest_chunk = min(chunking.chunk_bytes, chunking.max_chunk_bytes or chunking.chunk_bytes)
    return any(value.op.startswith("nll_loss") and
               max((problem.storage_bytes[problem.values[i].storage] for i in value.inputs), default=0)
               > smallest_chunk for value in problem.values)


def _splits(traced: TracedStep) -> bool:
    """Whether a step traced with the loss chunked has a loss cut into more than one chunk: one
    chunk lowers no peak and adds the head's matmul, so the automatic rule never chunks then."""
    return any(region.chunks > 1 for region in traced.chunked)


def _output(output: Any, *_inputs: Any, **_kwargs: Any) -> Any:
    return output


# --- tracing without memory -------------------------------------------------------------------


def _tensors(model: nn.Module, inputs: tuple[Any, ...]) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()
    yield from (x for x in inputs if isinstance(x, torch.Tensor))


@contextlib.contextmanager
def traceable(model: nn.Module, inputs: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
    """Inputs ready to trace: meta tensors become fake CPU tensors for the duration (the model's
    parameters and buffers are swapped in place and put back afterwards); fake tensors are
    traced in their own mode; real tensors are left alone."""
    tensors = list(_tensors(model, inputs))
    fakes = [t for t in tensors if is_fake(t)]
    if fakes:
        mode = fakes[0].fake_mode
        allowed = mode.allow_non_fake_inputs
        mode.allow_non_fake_inputs = True  # factory calls in forward (torch.arange) make real tensors
        try:
            yield inputs
        finally:
            mode.allow_non_fake_inputs = allowed
        return
    if not any(t.device.type == "meta" for t in tensors):
        yield inputs
        return
    with _as_fake_cpu(model, inputs) as converted:
        yield converted


@contextlib.contextmanager
def _as_fake_cpu(model: nn.Module, inputs: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
    mode = fake_tensor_mode(allow_non_fake_inputs=True)
    made: dict[int, torch.Tensor] = {}  # tied weights stay tied

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in made:
            if tensor.device.type == "meta":
                with mode:
                    copy = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype,
                                               device="cpu")
            else:
                copy = mode.from_tensor(tensor)
            if isinstance(tensor, nn.Parameter):
                copy = nn.Parameter(copy, requires_grad=tensor.requires_grad)
            else:
                copy.requires_grad_(tensor.requires_grad)
            made[id(tensor)] = copy
        return made[id(tensor)]

    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, tensor in list(table.items()):
                    if tensor is not None:
                        swapped.append((table, name, tensor))
                        table[name] = fake(tensor)
        yield tuple(fake(x) if isinstance(x, torch.Tensor) else x for x in inputs)
    finally:
        for table, name, tensor in reversed(swapped):
            table[name] = tensor


__all__ = ["PlanReport", "plan", "plan_with_report", "traceable"]
