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
from dataclasses import dataclass, field
from typing import Iterable

# Tags annotate puts on values; planners may read them, nothing requires them.
TAG_RANDOM = "random"
TAG_MUTATION = "mutation"
TAG_VIEW = "view"
TAG_MATMUL = "matmul"
TAG_ATTENTION_CORE = "attention_core"
TAG_DROPOUT_REPLAY = "dropout_replay"  # a dropout output rebuilt from its input and kept mask


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


@dataclass(frozen=True)
class Problem:
    """Forward values in topological order (``values[i].id == i``) and what backward reads.

    ``storage_bytes[s]`` is the size of storage ``s``; available storages are 0.
    """

    values: tuple[Value, ...]
    storage_bytes: tuple[int, ...]
    backward_reads: frozenset[int]
    device: str = "cpu"

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
        for read in self.backward_reads:
            if not 0 <= read < len(self.values):
                raise ValueError(f"backward reads unknown value id {read}")
            if not (self.values[read].keepable or self.values[read].available):
                raise ValueError(f"backward reads {self.values[read].name!r}, which can be neither kept nor had")

    @property
    def users(self) -> tuple[tuple[int, ...], ...]:
        """users[i]: forward values that read value i."""
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


@dataclass(frozen=True)
class Plan:
    """Which forward values to keep and which to recompute, and what that is predicted to cost.

    ``kept`` holds the non-available values saved for backward; available values backward or a
    recomputation reads are implicit. Invalid plans cannot be built: see ``check``.
    """

    problem: Problem = field(repr=False)
    kept: frozenset[int]
    recomputed: frozenset[int]
    solver: str
    status: str = "optimal"
    gap: float | None = 0.0
    solve_seconds: float = 0.0
    budget_bytes: int | None = None

    def __post_init__(self) -> None:
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
        have = self.kept | self.recomputed
        needed = set(self.problem.backward_reads)
        for i in self.recomputed:
            needed.update(values[i].inputs)
        missing = [values[i].name for i in sorted(needed) if i not in have and not values[i].available]
        if missing:
            raise ValueError(f"backward needs values that are neither kept nor recomputed: {missing[:10]}")

    @property
    def kept_bytes(self) -> int:
        """Predicted bytes saved for backward (storages counted once)."""
        return self.problem.bytes_of(self.kept)

    @property
    def keep_all_bytes(self) -> int:
        return self.problem.keep_all_bytes()

    @property
    def kept_fraction(self) -> float:
        total = self.keep_all_bytes
        return self.kept_bytes / total if total else 0.0

    @property
    def recompute_seconds(self) -> float:
        """Predicted extra time in backward."""
        return sum(self.problem.values[i].recompute_seconds for i in self.recomputed)

    @property
    def recompute_flops(self) -> int:
        return sum(self.problem.values[i].flops for i in self.recomputed)

    def with_budget(self, budget_bytes: int | None) -> "Plan":
        return dataclasses.replace(self, budget_bytes=budget_bytes)

    def summary(self, limit: int = 15) -> str:
        """A readable account: totals, then the largest kept and recomputed values."""
        values = self.problem.values
        budget = "none" if self.budget_bytes is None else format_bytes(self.budget_bytes)
        gap = "n/a" if self.gap is None else f"{self.gap:.2%}"
        lines = [
            f"Plan by {self.solver} ({self.status}, gap {gap}, {self.solve_seconds:.2f}s)",
            f"  budget          {budget}",
            f"  kept            {format_bytes(self.kept_bytes)} of {format_bytes(self.keep_all_bytes)} "
            f"({self.kept_fraction:.1%}) in {len(self.kept)} values",
            f"  recomputed      {len(self.recomputed)} values, {self.recompute_flops / 1e6:.2f} MFLOP, "
            f"~{self.recompute_seconds * 1e3:.3f} ms estimated",
        ]
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
