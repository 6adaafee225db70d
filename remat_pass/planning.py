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
import dataclasses
import logging
from collections import Counter
from typing import Any, Iterator

import torch
from torch import nn

from remat_pass import solvers
from remat_pass.solvers.baselines import block_of
from remat_pass.solvers.problem import Plan, Problem, format_bytes

from .budget import parse_budget
from .costs import DeviceProfile
from .offload import check_offload_options, parse_host_budget
from .pipeline import (
    DEFAULT_BUDGET,
    DEFAULT_TIME_LIMIT,
    BudgetKind,
    LossFn,
    PlanOptions,
    as_inputs,
    plan_problem,
    resolve_budget_kind,
    trace_step,
)
from .report import format_flops

logger = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class PlanReport:
    """A plan and what the traced step adds to it: FLOPs and forward time, to put recompute in proportion."""

    plan: Plan
    step_flops: int
    forward_seconds: float
    pieces: int = 1

    def render(self, depth: int | None = None, limit: int = 200) -> str:
        """Headline, predicted activation memory and recompute overhead, then one row per module at ``depth``
        (default: the depth of the repeated blocks, e.g. "model.layers.12")."""
        return report(self.plan, depth=depth, step_flops=self.step_flops, forward_seconds=self.forward_seconds,
                      limit=limit)

    def __str__(self) -> str:
        return self.render()


def plan(
    model: nn.Module,
    example_inputs: Any,
    budget: object = DEFAULT_BUDGET,
    *,
    device: str | DeviceProfile = "h100",
    solver: str = "fast",
    budget_kind: str = BudgetKind.AUTO,
    loss_fn: LossFn | None = None,
    time_limit: float = DEFAULT_TIME_LIMIT,
    verbose: bool = False,
    depth: int | None = None,
    offload: bool = False,
    host_budget: object = None,
    **solver_options: Any,
) -> Plan:
    """Decide what ``model``'s training step keeps and recomputes under ``budget``; run nothing.

    ``budget`` as for ``optimize`` (a fraction of the saved bytes, or an absolute size; see
    ``budget_kind``). ``device`` picks the cost model ("cpu", "a100", "h100", "h200"), ``solver``
    any name in ``solvers.SOLVERS`` ("fast" scales to deep models; "ilp" is exact but slow there).
    Parameters, buffers and inputs on the meta device are traced as fake tensors, nothing is
    allocated; real tensors run one forward on their device. ``loss_fn(output, *inputs)`` makes
    the loss part of the planned step. ``verbose`` prints ``report(plan)`` per module at ``depth``.
    ``offload=True`` also lets saved values go to host memory (``optimize``'s option).

    Raises BudgetInfeasibleError (with the smallest feasible budget) when nothing fits.
    """
    report_ = plan_with_report(model, example_inputs, budget, device=device, solver=solver, budget_kind=budget_kind,
                               loss_fn=loss_fn, time_limit=time_limit, offload=offload, host_budget=host_budget,
                               **solver_options)
    if verbose:
        print(report_.render(depth=depth))
    return report_.plan


def plan_with_report(
    model: nn.Module,
    example_inputs: Any,
    budget: object = DEFAULT_BUDGET,
    *,
    device: str | DeviceProfile = "h100",
    solver: str = "fast",
    budget_kind: str = BudgetKind.AUTO,
    loss_fn: LossFn | None = None,
    time_limit: float = DEFAULT_TIME_LIMIT,
    offload: bool = False,
    host_budget: object = None,
    **solver_options: Any,
) -> PlanReport:
    """``plan`` plus the step's FLOPs and forward time, for ``PlanReport.render``."""
    if solver not in solvers.SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(sorted(solvers.SOLVERS))}")
    parsed = parse_budget(budget)
    resolve_budget_kind(parsed, budget_kind)  # reject a bad kind before tracing
    check_offload_options(offload, device, solver)
    with traceable(model, as_inputs(example_inputs)) as inputs:
        # Always through trace_step's loss wrapper: module paths then read as the model names them,
        # even when the model's forward is itself wrapped (Hugging Face decorators).
        traced = trace_step(model, inputs, loss_fn=loss_fn or _output, device=device)
    options = PlanOptions(parsed, solver, device, time_limit, budget_kind, dict(solver_options), offload=offload,
                          host_budget_bytes=parse_host_budget(host_budget))
    made = plan_problem(traced.problem, options).plan
    forward = sum(v.recompute_seconds for v in traced.problem.values if not v.available)
    return PlanReport(made, traced.step_flops, forward, traced.pieces)


def _output(output: Any, *_inputs: Any) -> Any:
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
    fakes = [t for t in tensors if isinstance(t, torch._subclasses.fake_tensor.FakeTensor)]
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
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
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


# --- the account ------------------------------------------------------------------------------


def block_depth(problem: Problem) -> int | None:
    """How many path parts name a repeated block ("model.layers.12" -> 3); None without blocks."""
    prefixes = Counter(block_of(v.module) for v in problem.values if v.module)
    prefixes.pop(None, None)
    if not prefixes:
        return None
    common = Counter(len(p.split(".")) for p in prefixes)
    return common.most_common(1)[0][0]


def report(plan: Plan, *, depth: int | None = None, step_flops: int | None = None,
           forward_seconds: float | None = None, limit: int = 200) -> str:
    """Plain-text account of a plan: totals, predicted memory, recompute overhead, per-module rows."""
    problem = plan.problem
    depth = depth if depth is not None else block_depth(problem)
    gap = "n/a" if plan.gap is None else f"{plan.gap:.2%}"
    budget = "none" if plan.budget_bytes is None else format_bytes(plan.budget_bytes)
    lines = [
        f"Plan by {plan.solver} ({plan.status}, gap {gap}, solved in {plan.solve_seconds:.2f}s) on {problem.device}",
        f"  budget           {budget} ({'peak of the step' if plan.budget_kind == 'peak' else 'saved for backward'})",
        f"  activations kept {format_bytes(plan.kept_bytes)} of {format_bytes(plan.keep_all_bytes)} without remat "
        f"({plan.kept_fraction:.1%})",
    ]
    if plan.predicted_peak_bytes is not None:
        lines.append(f"  predicted peak   {format_bytes(plan.predicted_peak_bytes)} of activation memory in the step "
                     "(activations, their gradients and recomputed temporaries; no weights or optimizer state)")
    if plan.offloaded:
        lines.append(f"  offloaded        {format_bytes(plan.offloaded_bytes)} to host memory, "
                     f"{plan.exposed_transfer_seconds * 1e3:.3f} ms of transfer not hidden by compute")
    overhead = f"  recompute        {plan.recompute_seconds * 1e3:.3f} ms ({problem.device} roofline), " \
               f"{format_flops(plan.recompute_flops)}"
    if step_flops:
        overhead += f" = {plan.recompute_flops / step_flops:.2%} of the step's {format_flops(step_flops)}"
    lines.append(overhead)
    if forward_seconds:
        lines.append(f"                   ~{plan.recompute_seconds / (3 * forward_seconds):.2%} of the step's time "
                     f"(estimated as 3x the forward's {forward_seconds * 1e3:.3f} ms)")
    rows = plan.per_module(depth)
    lines.append(f"  per module (depth {depth}): policy, kept / recomputed / keep-all bytes, recompute time")
    width = max((len(r.module) for r in rows), default=10)
    for row in rows[:limit]:
        lines.append(f"    {row.module or '(top level)':<{width}}  {row.policy:<9} {format_bytes(row.kept_bytes):>10} "
                     f"{format_bytes(row.recomputed_bytes):>10} {format_bytes(row.keep_all_bytes):>10} "
                     f"{row.recompute_seconds * 1e3:9.3f} ms")
    if len(rows) > limit:
        lines.append(f"    ... {len(rows) - limit} more")
    return "\n".join(lines)


__all__ = ["PlanReport", "block_depth", "plan", "plan_with_report", "report", "traceable"]
