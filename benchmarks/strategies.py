"""Memory strategies: each builds a training step from a fresh copy of the workload's seeded model.

A strategy is named by a string (``Strategy.parse``):

- ``none``: eager, everything autograd wants is saved.
- ``checkpoint_blocks``: ``checkpoint(block, x, use_reentrant=False)`` around every block (what
  Hugging Face's ``gradient_checkpointing_enable`` does; on a Hugging Face model, that itself).
- ``checkpoint_sequential``: ``checkpoint_sequential`` over the blocks with round(sqrt(n)) segments
  (Chen et al.'s sqrt(n) schedule; torch leaves the last segment uncheckpointed).
- ``sac``: selective activation checkpointing around every block: save matmul, convolution and SDPA
  outputs, recompute the rest (torchtitan's "selective op" policy).
- ``compile_mincut``: ``torch.compile`` with the default min-cut partitioner.
- ``compile_budget:SOLVER@F``: the same with ``torch._functorch.config.activation_memory_budget = F``
  and ``activation_memory_budget_solver = SOLVER`` (dp, greedy, ilp; default dp).
- ``remat@F``: ``remat_pass.optimize(model, budget=F)``; F a float fraction of the keep-all bytes
  or an int number of bytes. ``remat:saved@F`` / ``remat:peak@F`` pass ``budget_kind``.
  ``remat@match:NAME`` (kind "saved") is resolved by the runner into the bytes strategy NAME
  measurably held for backward, ``remat:peak@match:NAME`` into NAME's measured activation peak.
  A third part names remat_pass's cost profile for that row (``optimize(device=...)``), e.g.
  ``remat:peak:flops@match:NAME`` or ``remat::cpu@0.3``; without it the run's ``--remat-costs``.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from benchmarks.models import Workload

FAMILIES = (
    "none", "checkpoint_blocks", "checkpoint_sequential", "sac", "compile_mincut", "compile_budget", "remat",
)
COMPILE_SOLVERS = ("dp", "greedy", "ilp")
REMAT_KINDS = ("saved", "peak")


@dataclass(frozen=True)
class Strategy:
    """A parsed strategy name. ``budget`` is a float fraction, int bytes, "match:NAME" or None.

    ``solver`` is the knapsack solver for compile_budget and the budget kind ("saved", "peak")
    for remat, where None leaves remat_pass's default (a float bounds saved bytes, an int the peak).
    ``costs`` (remat only) is the cost profile for this row; None leaves the run's.
    """

    family: str
    budget: float | int | str | None = None
    solver: str | None = None
    costs: str | None = None

    @classmethod
    def parse(cls, text: str) -> "Strategy":
        name, _, budget_text = text.partition("@")
        family, _, qualifiers = name.partition(":")
        solver, _, costs = qualifiers.partition(":")
        if costs and family != "remat":
            raise ValueError(f"{text!r}: only remat takes a cost profile (remat:KIND:COSTS@BUDGET)")
        if family not in FAMILIES:
            raise ValueError(f"unknown strategy {text!r}; families are {', '.join(FAMILIES)}")
        budget: float | int | str | None = None
        if family in ("compile_budget", "remat"):
            if not budget_text:
                raise ValueError(f"{text!r} needs a budget, e.g. {family}@0.5")
            if budget_text.startswith("match:"):
                if family != "remat":
                    raise ValueError(f"{text!r}: only remat takes a match: budget")
                budget = budget_text
            elif budget_text.isdigit():
                budget = int(budget_text)
            else:
                budget = float(budget_text)
                if not 0.0 <= budget <= 1.0:
                    raise ValueError(f"{text!r}: a fractional budget must lie in [0, 1]")
        elif budget_text:
            raise ValueError(f"{text!r}: {family} takes no budget")
        if family == "compile_budget":
            solver = solver or "dp"
            if solver not in COMPILE_SOLVERS:
                raise ValueError(f"{text!r}: solver must be one of {', '.join(COMPILE_SOLVERS)}")
        elif family == "remat":
            if solver and solver not in REMAT_KINDS:
                raise ValueError(f"{text!r}: remat's budget kind must be one of {', '.join(REMAT_KINDS)}")
        elif solver:
            raise ValueError(f"{text!r}: only compile_budget (solver) and remat (budget kind) take a ':'")
        return cls(family, budget, solver or None, costs or None)

    @property
    def label(self) -> str:
        name = f"{self.family}:{self.solver or ''}:{self.costs}" if self.costs else (
            f"{self.family}:{self.solver}" if self.solver else self.family)
        return name if self.budget is None else f"{name}@{self.budget}"


@dataclass
class Prepared:
    """What the runner measures. ``forward`` returns the loss with its autograd graph."""

    forward: Callable[[], torch.Tensor]
    model: nn.Module
    params: list[nn.Parameter]
    context: Callable[[], ContextManager[Any]] = contextlib.nullcontext
    rng_matches_eager: bool = True
    eager: bool = True  # no torch.compile inside, so FlopCounterMode can see everything
    setup_seconds: float = 0.0
    plan: Callable[[], Any] = lambda: None  # the remat plan in use, read after a step
    notes: list[str] = field(default_factory=list)
    # For strategies that hold activations outside autograd's saved tensors (SAC's cache):
    # a context to record them during one forward, and the bytes it recorded.
    recording: Callable[[], ContextManager[Any]] = contextlib.nullcontext
    extra_saved_bytes: Callable[[list[torch.Tensor]], int] = lambda exclude: 0

    def step(self) -> torch.Tensor:
        with self.context():
            loss = self.forward()
            loss.backward()
        return loss.detach()

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None


@dataclass(frozen=True)
class Options:
    compile_backend: str = "aot_eager_decomp_partition"
    remat_costs: str = "auto"  # optimize(device=...): "auto", "cpu", "h100", ..., "flops"
    remat_time_limit: float | None = None  # optimize(time_limit=...); None leaves remat_pass's default


def prepare(strategy: Strategy, work: Workload, options: Options = Options()) -> Prepared:
    """Build ``strategy``'s step on a deep copy of ``work.model`` (same weights for everyone)."""
    model = copy.deepcopy(work.model)
    params = list(model.parameters())  # before wrapping: the base model's order
    builder = _BUILDERS[strategy.family]
    prepared = builder(strategy, work, model, options)
    prepared.params = params
    return prepared


def _loss(work: Workload, module: Callable[..., torch.Tensor]) -> Callable[[], torch.Tensor]:
    return lambda: work.loss_fn(module(*work.inputs), work.target)


def _none(strategy: Strategy, work: Workload, model: nn.Module, options: Options) -> Prepared:
    return Prepared(_loss(work, model), model, [])


class _Checkpointed(nn.Module):
    """``checkpoint`` around one block, optionally with a SAC ``context_fn``."""

    def __init__(self, block: nn.Module, context_fn: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self.block = block
        self.context_fn = context_fn
        self.seen_inputs: list[torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seen_inputs is not None:
            self.seen_inputs.append(x)
        if self.context_fn is None:
            return checkpoint(self.block, x, use_reentrant=False)
        return checkpoint(self.block, x, use_reentrant=False, context_fn=self.context_fn)


def _blocks(model: nn.Module) -> nn.ModuleList:
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no `blocks` ModuleList to checkpoint")
    return blocks


def _hf_checkpointable(model: nn.Module) -> nn.Module | None:
    """The outermost Hugging Face model inside ``model`` that can checkpoint its own layers."""
    for module in model.modules():
        if getattr(module, "supports_gradient_checkpointing", False) and hasattr(
                module, "activation_checkpointing_enable"):
            return module
    return None


def _checkpoint_blocks(strategy: Strategy, work: Workload, model: nn.Module, options: Options) -> Prepared:
    hf = _hf_checkpointable(model) if not hasattr(model, "blocks") else None
    if hf is not None:
        # Hugging Face's layers take keyword arguments (masks, rotary tables): its own wrapper
        # checkpoints each one as torch.utils.checkpoint would.
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return Prepared(_loss(work, model), model, [], notes=["Hugging Face activation_checkpointing_enable"])
    blocks = _blocks(model)
    for i, block in enumerate(list(blocks)):
        blocks[i] = _Checkpointed(block)
    return Prepared(_loss(work, model), model, [])


class _SequentialCheckpoint(nn.Module):
    def __init__(self, blocks: nn.ModuleList, segments: int) -> None:
        super().__init__()
        self.inner = nn.Sequential(*blocks)
        self.segments = segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_sequential(self.inner, self.segments, x, use_reentrant=False)


def _checkpoint_sequential(strategy: Strategy, work: Workload, model: nn.Module, options: Options) -> Prepared:
    blocks = _blocks(model)
    segments = max(1, round(math.sqrt(len(blocks))))
    model.blocks = nn.ModuleList([_SequentialCheckpoint(blocks, segments)])
    return Prepared(_loss(work, model), model, [], notes=[f"{segments} segments over {len(blocks)} blocks"])


def _sac_save_ops() -> set[Any]:
    aten = torch.ops.aten
    names = [
        "mm", "bmm", "addmm", "convolution",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    ]
    # Not every build has every attention kernel; skip those it lacks.
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


class _SACRecorder:
    """Creates SAC contexts; while recording (``modes`` is a list) keeps weak references to them."""

    def __init__(self) -> None:
        from torch.utils.checkpoint import CheckpointPolicy

        save = _sac_save_ops()
        self._must_save, self._recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
        self.policy = lambda ctx, op, *args, **kwargs: (
            self._must_save if op in save else self._recompute
        )
        self.modes: list[weakref.ref] | None = None

    def context_fn(self) -> tuple[Any, Any]:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        caching, cached = create_selective_checkpoint_contexts(self.policy)
        if self.modes is not None:
            # The forward-side mode dies after the forward; the recompute-side one, which
            # shares the cache, lives until backward.
            self.modes.append(weakref.ref(cached))
        return caching, cached

    def cached_tensors(self) -> list[torch.Tensor]:
        found: list[torch.Tensor] = []
        for ref in self.modes or []:
            mode = ref()
            if mode is not None:
                _collect_tensors(getattr(mode, "storage", {}), found)
        return found


def _collect_tensors(obj: Any, found: list[torch.Tensor]) -> None:
    # The SAC cache's layout changes between torch versions (lists, then dicts of indices).
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _collect_tensors(value, found)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _collect_tensors(value, found)
    elif hasattr(obj, "val"):
        _collect_tensors(obj.val, found)


def _sac(strategy: Strategy, work: Workload, model: nn.Module, options: Options) -> Prepared:
    blocks = _blocks(model)
    recorder = _SACRecorder()
    wrapped = [_Checkpointed(block, recorder.context_fn) for block in blocks]
    for i, block in enumerate(wrapped):
        blocks[i] = block

    @contextlib.contextmanager
    def recording() -> Iterator[None]:
        recorder.modes = []
        for block in wrapped:
            block.seen_inputs = []
        try:
            yield
        finally:
            recorder.modes = None
            for block in wrapped:
                block.seen_inputs = None

    def extra_saved_bytes(exclude: list[torch.Tensor]) -> int:
        # Block inputs are saved through autograd (counted by the hooks); do not count twice.
        block_inputs = [x for block in wrapped for x in block.seen_inputs or []]
        from benchmarks.metrics import storage_bytes

        return storage_bytes(recorder.cached_tensors(), exclude=[*exclude, *block_inputs])

    return Prepared(
        _loss(work, model), model, [], recording=recording, extra_saved_bytes=extra_saved_bytes,
        notes=[f"saves {len(_sac_save_ops())} op kinds"],
    )


def _compile(strategy: Strategy, work: Workload, model: nn.Module, options: Options) -> Prepared:
    import torch._dynamo
    import torch._functorch.config as functorch_config

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=options.compile_backend)
    patches: dict[str, Any] = {}
    if strategy.family == "compile_budget":
        patches = {
            "activation_memory_budget": float(strategy.budget),  # type: ignore[arg-type]
            "activation_memory_budget_solver": strategy.solver,
        }
    notes = [f"backend={options.compile_backend}"]
    # Dropout inside a compiled graph draws its masks differently from eager (decomposed to
    # rand/bernoulli, inductor's own RNG): same seed, different masks.
    rng_matches = not any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())
    return Prepared(
        _loss(work, compiled), model, [],
        # Patched on every call, not just the first: a recompile must see the same budget.
        context=lambda: functorch_config.patch(**patches),
        rng_matches_eager=rng_matches, eager=False, notes=notes,
    )


def remat_optimize() -> tuple[Callable[..., Any] | None, str]:
    """``remat_pass.optimize`` if it imports, else None and why not."""
    try:
        from remat_pass import optimize
    except Exception as error:  # noqa: BLE001 - any import failure means "not available yet"
        return None, f"{type(error).__name__}: {error}"
    return optimize, ""


def _remat(strategy: Strategy, work: Workload, model: nn.Module, options: Options) -> Prepared:
    optimize, why = remat_optimize()
    if optimize is None:
        raise ImportError(f"remat_pass.optimize is not importable ({why})")
    if isinstance(strategy.budget, str):
        raise ValueError(f"{strategy.label}: resolve match: budgets before preparing")
    kwargs: dict[str, Any] = {}
    if strategy.solver is not None:
        if "budget_kind" in inspect.signature(optimize).parameters:
            kwargs["budget_kind"] = strategy.solver
        elif strategy.solver != "saved":  # without budget_kind, budgets bound the saved bytes
            raise TypeError(f"{strategy.label}: this remat_pass.optimize takes no budget_kind")
    start = time.perf_counter()
    costs = strategy.costs or options.remat_costs
    if costs in ("roofline", "flops", "measure"):  # how recompute is priced (optimize's costs=)
        kwargs["costs"] = costs
    elif costs != "auto":  # a device profile by name (optimize's device=)
        kwargs["device"] = costs
    if options.remat_time_limit is not None:
        kwargs["time_limit"] = options.remat_time_limit
    kwargs["plan_cache"] = None  # time the planning: no plan from an earlier run's cache (None: off in every version)
    # The loss is compiled with the model: the budget then covers the whole step, as the README
    # asks of users, and its logits are freed inside the step (outside it, remat_pass must count
    # them live to the end). On the H200 a 50k-vocabulary loss outside the plan put the measured
    # peak 28% over a peak budget (benchmarks/GPU.md, run 2).
    step = _StepWithLoss(model, work.loss_fn)
    optimized = optimize(step, budget=strategy.budget, example_inputs=(*work.inputs, work.target), **kwargs)
    setup = time.perf_counter() - start
    return Prepared(
        lambda: optimized(*work.inputs, work.target), model, [], setup_seconds=setup,
        plan=lambda: getattr(optimized, "plan", None), eager=False,
    )


class _StepWithLoss(nn.Module):
    """``loss_fn(model(*inputs), target)`` as one module (it shares ``model``'s parameters)."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, *inputs_and_target: torch.Tensor) -> torch.Tensor:
        *inputs, target = inputs_and_target
        return self.loss_fn(self.model(*inputs), target)


_BUILDERS: dict[str, Callable[[Strategy, Workload, nn.Module, Options], Prepared]] = {
    "none": _none,
    "checkpoint_blocks": _checkpoint_blocks,
    "checkpoint_sequential": _checkpoint_sequential,
    "sac": _sac,
    "compile_mincut": _compile,
    "compile_budget": _compile,
    "remat": _remat,
}


def step_with_loss(model: nn.Module, loss_fn: Callable[..., torch.Tensor]) -> nn.Module:
    """``loss_fn(model(*inputs), target)`` as one module, called ``(*inputs, target)``: for
    benchmarks that compile (or plan) the whole step, the loss's temporaries included."""
    return _StepWithLoss(model, loss_fn)


def checkpoint_every_block(work: Workload, model: nn.Module) -> list[str]:
    """Per-block checkpointing (``checkpoint_blocks``) applied to ``model`` in place, Hugging
    Face's own where the model has it; returns the strategy's notes."""
    return _checkpoint_blocks(Strategy("checkpoint_blocks"), work, model, Options()).notes
