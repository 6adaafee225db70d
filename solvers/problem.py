"""The torch-free planning problem and its answer.

A ``Problem`` is what the annotate stage distils from a joint forward+backward graph: the
forward values with integer ids, which storage each one lives in, how much it costs to
recompute, and which of them the backward pass reads. A ``Plan`` says, for one budget,
which values are kept (saved for backward) and which are recomputed in backward.

Nothing here imports torch, so every planner can be tested with literal lists.

Vocabulary
----------
available
    Present in backward at no cost: parameters, buffers, user inputs and views of them.
    Their storages are charged 0 bytes.
keepable
    Can be saved for backward. Tuple-valued nodes (the multi-output op itself, not its
    ``getitem`` results) cannot.
recomputable
    Can be run again in backward without changing the result or repeating a side effect.
    Random ops (dropout) and mutations are not.
storage
    Views share their base's storage; keeping any number of values of one storage costs
    that storage's bytes once.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from .module_account import ModuleRow, module_rows
from .status import BudgetKind, Status

STEP_IN_FORWARDS = 3
"""A training step's time as a multiple of its forward's, where only the forward is priced (the
backward does about twice the forward's work): what ``explain`` and the Inductor fit estimate a step at."""

# A Plan's accounts that need an analysis above these records: how many times backward makes each
# refreshed value (``analysis.lifetimes.materializations``) and the transfer time the host link
# does not hide (``analysis.transfers.transfer_schedule``). The records import no analysis, so no
# import circle runs through them: each of those modules puts its function here when imported, and
# the package (``solvers/__init__.py``, which Python runs before any module in it) imports both.
ANALYSES: dict[str, Callable[..., Any]] = {}


def _analysis(name: str) -> Callable[..., Any]:
    try:
        return ANALYSES[name]
    except KeyError:
        raise RuntimeError(f"the analysis {name!r} is not registered (import remat_pass.solvers)") from None


@dataclass(frozen=True)
class Value:
    """One forward value of the joint graph (a node's output)."""

    id: int
    name: str
    inputs: tuple[int, ...]
    storage: int
    recompute_seconds: float = 0.0
    flops: int = 0
    recomputable: bool = True
    keepable: bool = True
    available: bool = False
    module: str = ""
    op: str = ""
    tags: frozenset[str] = frozenset()
    scratch_bytes: int = 0  # the kernel's own working memory while it runs (forward or recompute)


@dataclass(frozen=True)
class BackwardStep:
    """One backward op, in execution order: the forward values it reads, and the bytes of
    backward-only tensors (activation gradients, tangents) live while it runs.

    ``working_bytes`` does not depend on the plan; what the plan changes is which forward
    values are alive next to it. Parameter gradients are not counted. ``scratch_bytes`` is the
    part of it that is the kernel's own working memory, live while the op runs and not while
    the recomputations before the next step do.
    """

    reads: tuple[int, ...]
    working_bytes: int = 0
    seconds: float = 0.0  # the op's roofline time: backward compute that can hide a reload
    scratch_bytes: int = 0


@dataclass(frozen=True)
class Problem:
    """Forward values in topological order (``values[i].id == i``) and what backward reads.

    ``storage_bytes[s]`` is the size of storage ``s``; available storages are 0.
    ``forward_outputs`` (values the forward returns to the user or to buffers) and
    ``backward_steps`` (the backward pass in order) feed the peak-memory model; planners that
    only bound saved bytes ignore them. ``host_bytes_per_second`` is the device's host link,
    per direction (0: no offload, as on a CPU, whose host and device memory are the same).
    """

    values: tuple[Value, ...]
    storage_bytes: tuple[int, ...]
    backward_reads: frozenset[int]
    device: str = "cpu"
    forward_outputs: frozenset[int] = frozenset()
    backward_steps: tuple[BackwardStep, ...] = ()
    host_bytes_per_second: float = 0.0
    costs: str = "roofline"  # how recompute_seconds were priced: roofline, flops or measure
    # What was done to the graph before it was planned, for the plan's reader (a chunked loss).
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Reject records that no planner could interpret; raises ValueError."""
        for index, value in enumerate(self.values):
            if value.id != index:
                raise ValueError(f"value {value.name!r} has id {value.id}, expected {index} (ids are positions)")
            for source in value.inputs:
                if not 0 <= source < index:
                    raise ValueError(
                        f"value {value.name!r} reads id {source}; inputs must come earlier in topological order"
                    )
            if not 0 <= value.storage < len(self.storage_bytes):
                raise ValueError(f"value {value.name!r} has unknown storage {value.storage}")
            if value.available and self.storage_bytes[value.storage] != 0:
                raise ValueError(f"available value {value.name!r} must live in a 0-byte storage")
        for step in self.backward_steps:
            for read in step.reads:
                if read not in self.backward_reads:
                    raise ValueError(f"a backward step reads value id {read}, which is not in backward_reads")
        for read in self.backward_reads:
            if not 0 <= read < len(self.values):
                raise ValueError(f"backward reads unknown value id {read}")
            if not (self.values[read].keepable or self.values[read].available):
                raise ValueError(f"backward reads {self.values[read].name!r}, which can be neither kept nor had")

    @functools.cached_property
    def users(self) -> tuple[tuple[int, ...], ...]:
        """users[i]: forward values that read value i. Computed once per problem: the exact rows
        ask for it per value and step (at 48 layers one round's rows took 48 s, 44 s of it here)."""
        result: list[list[int]] = [[] for _ in self.values]
        for value in self.values:
            for source in value.inputs:
                result[source].append(value.id)
        return tuple(tuple(u) for u in result)

    def bytes_of(self, value_ids: Iterable[int]) -> int:
        """Bytes needed to keep these values: each storage counted once."""
        storages = {self.values[i].storage for i in value_ids}
        return sum(self.storage_bytes[s] for s in storages)

    def keep_all_bytes(self) -> int:
        """What the un-rematerialized step keeps: every value backward reads."""
        return self.bytes_of(self.backward_reads)

    def forward_seconds(self) -> float:
        """The cost model's time for the forward: every value the step computes, once (a step is
        about ``STEP_IN_FORWARDS`` forwards)."""
        return sum(v.recompute_seconds for v in self.values if not v.available)


@dataclass(frozen=True)
class Plan:
    """Which forward values to keep and which to recompute, and what that is predicted to cost.

    ``kept`` holds the non-available values saved for backward on the device; available values
    backward or a recomputation reads are implicit. ``offloaded`` holds values saved for
    backward in host memory (sent over the host link in forward, fetched back before backward
    needs them; ``solvers.analysis.transfers``): a storage is either kept or offloaded, never both.
    ``refreshed`` (multiple recomputation, ``solvers.peak.multiple_recompute``): recomputed values made again in
    each backward step that needs them instead of held; priced once per time made.
    ``fused``: recomputed values the planner kept and the compiler's pass moved to recompute,
    because Inductor fuses their recompute into their backward readers for free
    (``remat_pass.planning.fused_free``); a subset of ``recomputed``.
    Invalid plans cannot be built: see ``check``.
    """

    problem: Problem = field(repr=False)
    kept: frozenset[int]
    recomputed: frozenset[int]
    solver: str
    status: Status = Status.OPTIMAL
    gap: float | None = 0.0
    solve_seconds: float = 0.0
    budget_bytes: int | None = None
    budget_kind: BudgetKind = BudgetKind.SAVED  # what the budget bounds: kept bytes, or the simulated step peak
    predicted_peak_bytes: int | None = None
    offloaded: frozenset[int] = frozenset()
    host_budget_bytes: int | None = None
    refreshed: frozenset[int] = frozenset()
    fused: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        # Plain strings are accepted (a plan read back from JSON); an unknown one is a ValueError.
        object.__setattr__(self, "status", Status(self.status))
        object.__setattr__(self, "budget_kind", BudgetKind(self.budget_kind))
        self.check()

    def check(self) -> None:
        """Raise ValueError unless every value backward needs can be had in backward."""
        values = self.problem.values
        both = self.kept & self.recomputed
        if both:
            raise ValueError(f"values both kept and recomputed: {sorted(values[i].name for i in both)}")
        for i in self.kept:
            if not values[i].keepable or values[i].available:
                raise ValueError(f"{values[i].name!r} is kept but is not keepable (or is available anyway)")
        for i in self.recomputed:
            if not values[i].recomputable:
                raise ValueError(f"{values[i].name!r} is recomputed but must not be (random op or side effect)")
        self._check_offloaded()
        if self.refreshed:
            self._check_refreshed()
        if not self.fused <= self.recomputed:
            raise ValueError(f"fused values that are not recomputed: {sorted(values[i].name for i in self.fused - self.recomputed)[:10]}")
        have = self.kept | self.recomputed | self.offloaded
        needed = set(self.problem.backward_reads)
        for i in self.recomputed:
            needed.update(values[i].inputs)
        missing = [values[i].name for i in sorted(needed) if i not in have and not values[i].available]
        if missing:
            raise ValueError(f"backward needs values that are neither kept nor recomputed: {missing[:10]}")

    def _check_offloaded(self) -> None:
        values = self.problem.values
        for i in self.offloaded & (self.kept | self.recomputed):
            raise ValueError(f"{values[i].name!r} is offloaded and also kept or recomputed")
        for i in self.offloaded:
            if not values[i].keepable or values[i].available:
                raise ValueError(f"{values[i].name!r} is offloaded but is not keepable (or is available anyway)")
        shared = {values[i].storage for i in self.offloaded} & {values[i].storage for i in self.kept}
        if shared:
            raise ValueError(f"storages both kept on the device and offloaded: {sorted(shared)[:10]} "
                             "(a storage is offloaded once, with all its views)")
        if self.offloaded and self.problem.host_bytes_per_second <= 0:
            raise ValueError(f"offloaded values on device {self.problem.device!r}, which has no host link")

    def _check_refreshed(self) -> None:
        """Raise ValueError unless every refreshed storage is one tensor per step: every value of
        it that backward has is a refreshed recomputation (none kept, offloaded or returned)."""
        values = self.problem.values
        if not self.refreshed <= self.recomputed:
            raise ValueError(f"refreshed values that are not recomputed: "
                             f"{sorted(values[i].name for i in self.refreshed - self.recomputed)[:10]}")
        storages = {values[i].storage for i in self.refreshed}
        for i in self.kept | self.offloaded | (self.recomputed - self.refreshed):
            if values[i].storage in storages:
                raise ValueError(f"{values[i].name!r} shares a storage with a refreshed value but is not refreshed")
        if storages & {values[i].storage for i in self.problem.forward_outputs}:
            raise ValueError("a refreshed value shares a storage with a forward output")

    @functools.cached_property
    def _materializations(self) -> dict[int, int]:
        """How many times backward makes each recomputed value (``lifetimes.materializations``)."""
        if not self.refreshed:
            return dict.fromkeys(self.recomputed, 1)
        return _analysis("materializations")(self.problem, self)

    @property
    def kept_bytes(self) -> int:
        """Predicted device bytes saved for backward (storages counted once; offloaded ones not)."""
        return self.problem.bytes_of(self.kept)

    @property
    def offloaded_bytes(self) -> int:
        """Bytes saved for backward in host memory: also the host memory the plan needs
        (pinned buffers, all alive between forward and backward)."""
        return self.problem.bytes_of(self.offloaded)

    @property
    def host_bytes(self) -> int:
        """Host memory the plan holds at its peak (between forward and backward)."""
        return self.offloaded_bytes

    @property
    def exposed_transfer_seconds(self) -> float:
        """Predicted transfer time not hidden behind compute (``solvers.analysis.transfers``'s link model)."""
        if not self.offloaded:
            return 0.0
        return _analysis("transfer_schedule")(self.problem, self).exposed_seconds

    @property
    def predicted_extra_seconds(self) -> float:
        """What the plan adds to the step: recompute time plus exposed transfer time."""
        return self.recompute_seconds + self.exposed_transfer_seconds

    @property
    def keep_all_bytes(self) -> int:
        return self.problem.keep_all_bytes()

    @property
    def kept_fraction(self) -> float:
        total = self.keep_all_bytes
        return self.kept_bytes / total if total else 0.0

    @property
    def recompute_seconds(self) -> float:
        """Predicted extra time in backward (a refreshed value once per time it is made)."""
        return sum(self.problem.values[i].recompute_seconds * n for i, n in self._materializations.items())

    @property
    def recompute_flops(self) -> int:
        return sum(self.problem.values[i].flops * n for i, n in self._materializations.items())

    def with_budget(self, budget_bytes: int | None) -> "Plan":
        return dataclasses.replace(self, budget_bytes=budget_bytes)

    def summary(self, limit: int = 15) -> str:
        """A readable account: totals, then the largest kept and recomputed values."""
        values = self.problem.values
        budget = "none" if self.budget_bytes is None else format_bytes(self.budget_bytes)
        gap = "n/a" if self.gap is None else f"{self.gap:.2%}"
        lines = [
            f"Plan by {self.solver} ({self.status}, gap {gap}, {self.solve_seconds:.2f}s)",
            f"  budget          {budget} ({'peak of the step' if self.budget_kind == 'peak' else 'saved for backward'})",
            f"  kept            {format_bytes(self.kept_bytes)} of {format_bytes(self.keep_all_bytes)} "
            f"({self.kept_fraction:.1%}) in {len(self.kept)} values",
            f"  recomputed      {len(self.recomputed)} values, {self.recompute_flops / 1e6:.2f} MFLOP, "
            f"~{self.recompute_seconds * 1e3:.3f} ms estimated",
        ]
        if self.refreshed:
            lines.append(f"  refreshed       {len(self.refreshed)} recomputed values made again per backward step")
        if self.fused:
            lines.append(f"  fused           {len(self.fused)} of them kept by the planner, recomputed because Inductor "
                         "fuses them into their readers")
        if self.offloaded:
            lines.append(f"  offloaded       {format_bytes(self.offloaded_bytes)} to host memory in {len(self.offloaded)} "
                         f"values, ~{self.exposed_transfer_seconds * 1e3:.3f} ms of transfer not hidden by compute")
        if self.predicted_peak_bytes is not None:
            lines.append(f"  predicted peak  {format_bytes(self.predicted_peak_bytes)} of activation memory in the step")
        lines += [f"  note            {note}" for note in self.problem.notes]
        sized = sorted(self.kept, key=lambda i: (-self.problem.storage_bytes[values[i].storage], i))
        if sized:
            lines.append("  largest kept:")
            lines += [_describe(self.problem, i) for i in sized[:limit]]
        costly = sorted(self.recomputed, key=lambda i: (-values[i].recompute_seconds, i))
        if costly:
            lines.append("  costliest recomputed:")
            lines += [_describe(self.problem, i) for i in costly[:limit]]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def per_module(self, depth: int | None = None) -> list[ModuleRow]:
        """What the plan does in each nn.Module: bytes kept and recomputed, extra cost, a policy label.

        Rows follow ``Value.module`` (innermost module; ``depth`` truncates paths to their first
        ``depth`` parts, so ``depth=2`` sums "blocks.0.attn" and "blocks.0.mlp" into "blocks.0"),
        in order of first appearance. Each storage is charged once, to the module of the value
        that created it (views, and detaches outside any module, count where their base was
        made), so the rows' ``kept_bytes`` add up to ``plan.kept_bytes``. Modules that create no
        bytes and recompute nothing (views only) get no row.

        The label is ``"none"`` (nothing recomputed), ``"full"`` (the module recomputes and keeps
        nothing but values other modules read: checkpointing, as ``torch.utils.checkpoint``
        would), ``"selective"`` (it keeps some of its own intermediates and recomputes others)
        or ``"offload"`` (it sends at least as many bytes to host memory as it recomputes).

        >>> x = Value(0, "x", (), storage=0, available=True)
        >>> h = Value(1, "h", (0,), storage=1, flops=8, module="block")
        >>> y = Value(2, "y", (1,), storage=2, module="head")
        >>> plan = Plan(Problem((x, h, y), (0, 4, 4), frozenset({1, 2})), frozenset({2}), frozenset({1}), "manual")
        >>> [(r.module, r.policy, r.kept_bytes, r.recomputed_bytes, r.recompute_flops) for r in plan.per_module()]
        [('block', 'full', 0, 4, 8), ('head', 'none', 4, 0, 0)]
        """
        return module_rows(self, depth)

    def to_dict(self, depth: int | None = None) -> dict[str, Any]:
        """A JSON-ready account: totals, every kept and recomputed value, and ``per_module(depth)``.

        Each value entry carries its storage id and that storage's bytes; values sharing a storage
        repeat its bytes, so add up ``kept_bytes``, not the entries.
        """
        problem = self.problem

        def entry(i: int) -> dict[str, Any]:
            value = problem.values[i]
            return {"id": i, "name": value.name, "op": value.op, "module": value.module, "storage": value.storage,
                    "bytes": problem.storage_bytes[value.storage], "recompute_seconds": value.recompute_seconds,
                    "flops": value.flops}

        return {
            "solver": self.solver,
            "status": self.status,
            "gap": _finite_or_none(self.gap),
            "solve_seconds": self.solve_seconds,
            "device": problem.device, "costs": problem.costs,
            "budget_bytes": self.budget_bytes,
            "budget_kind": self.budget_kind,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "kept_bytes": self.kept_bytes,
            "keep_all_bytes": self.keep_all_bytes,
            "kept_fraction": self.kept_fraction,
            "recompute_seconds": self.recompute_seconds,
            "recompute_flops": self.recompute_flops,
            "offloaded_bytes": self.offloaded_bytes,
            "host_bytes": self.host_bytes,
            "exposed_transfer_seconds": self.exposed_transfer_seconds,
            "kept": [entry(i) for i in sorted(self.kept)],
            "recomputed": [entry(i) for i in sorted(self.recomputed)],
            "offloaded": [entry(i) for i in sorted(self.offloaded)],
            "refreshed": [entry(i) | {"times": self._materializations[i]} for i in sorted(self.refreshed)],
            "fused": [entry(i) for i in sorted(self.fused)],
            "per_module": [dataclasses.asdict(row) for row in self.per_module(depth)],
        }

    def to_json(self, depth: int | None = None, indent: int | None = 2) -> str:
        """``to_dict(depth)`` as JSON text."""
        return json.dumps(self.to_dict(depth), indent=indent)


def _finite_or_none(number: float | None) -> float | None:
    return number if number is not None and math.isfinite(number) else None


def _describe(problem: Problem, value_id: int) -> str:
    value = problem.values[value_id]
    where = f" in {value.module}" if value.module else ""
    return (
        f"    {value.name:<28} {value.op:<28} {format_bytes(problem.storage_bytes[value.storage]):>10}"
        f"  {value.recompute_seconds * 1e6:9.1f} us{where}"
    )


def format_bytes(count: float) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def closure_from_keep_set(problem: Problem, keep: Iterable[int]) -> tuple[frozenset[int], frozenset[int]]:
    """Complete a set of values one wants to keep into a valid (kept, recomputed) pair.

    Walks back from what backward reads: a value in ``keep`` (or not recomputable) is kept,
    an available one is free, anything else is recomputed and its inputs are needed in turn.
    This is how every checkpointing baseline is defined: it names its checkpoints, the rest
    follows.
    """
    wanted = set(keep)
    values = problem.values
    rebuildable = recomputable_from_inputs(problem)
    kept: set[int] = set()
    recomputed: set[int] = set()
    stack = sorted(problem.backward_reads, reverse=True)
    seen: set[int] = set()
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        value = values[i]
        if value.available:
            continue
        if value.keepable and (i in wanted or not rebuildable[i]):
            kept.add(i)
        elif rebuildable[i]:
            recomputed.add(i)
            stack.extend(value.inputs)
        else:
            raise ValueError(f"{value.name!r} can be neither kept nor recomputed")
    return frozenset(kept), frozenset(recomputed)


def recomputable_from_inputs(problem: Problem) -> tuple[bool, ...]:
    """For each value: can backward rebuild it, given that keepable inputs could be kept?

    A ``getitem`` of a random tuple op is recomputable as an op, but its input can be neither
    kept (a tuple) nor recomputed (random): it has to be kept itself.
    """
    result: list[bool] = []
    for value in problem.values:
        result.append(
            value.recomputable
            and all(
                problem.values[u].available or problem.values[u].keepable or result[u] for u in value.inputs
            )
        )
    return tuple(result)
