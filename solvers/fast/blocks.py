"""Split a Problem into groups that can be planned apart, and find the identical blocks among them.

Transformers repeat one block; planning each copy again is wasted work. Here the forward values
are grouped by the repeated module they belong to (``Value.module`` up to its first numeric part:
"blocks.3", "model.layers.12"); values outside any block form "rest" groups, one per stretch
between blocks. Two rules keep the groups plannable apart:

* a storage and all its views live in one group (the group of the value that created it), so a
  storage's bytes are paid in one place;
* values the joint graph put outside every module (``module == ""``: the views and small ops
  AOTAutograd moved next to the backward ops) join the block all their inputs come from.

Groups interact only through values one group makes and another reads. When backward reads such
a value anyway it is needed in every plan and decouples the groups exactly. Otherwise it is a
*coupling* value: whether it is present in backward (kept or recomputed by its owner) is a choice
shared by its owner and its readers; ``solvers.mincut`` enumerates it (two states) in a dynamic
program over the groups in order.

Groups with the same *signature* (their values' ops, tags, costs, storage sizes, internal edges,
which inputs are coupling values, which values backward reads) have the same sub-problem for the
same coupling states, so one of them is solved and its answer is mapped onto the others by position.

>>> from remat_pass.solvers.problem import Problem, Value
>>> x = Value(0, "x", (), storage=0, available=True)
>>> a = Value(1, "a", (0,), storage=1, recompute_seconds=1.0, module="layers.0.fc")
>>> b = Value(2, "b", (1,), storage=2, recompute_seconds=1.0, module="layers.1.fc")
>>> split = decompose(Problem((x, a, b), (0, 8, 8), frozenset({1, 2})))
>>> [g.name for g in split.groups], split.block_classes()
(['layers.0', 'layers.1'], [['layers.0', 'layers.1']])
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Hashable, Mapping

from ..analysis.graph_facts import effectively_recomputable, relevant_values
from ..baselines import block_of
from ..problem import Problem

REST = "(rest)"


@dataclass(frozen=True)
class Group:
    """Values planned together: one block instance, or a stretch of values outside blocks.

    ``members``: relevant non-available value ids, ascending. ``touched``: the coupling values the
    group makes or reads, in a canonical order (groups with one signature list theirs alike).
    """

    name: str
    members: tuple[int, ...]
    is_block: bool
    touched: tuple[int, ...]
    signature: Hashable

    @property
    def first(self) -> int:
        return self.members[0]


@dataclass(frozen=True)
class Decomposition:
    """The groups of a problem (in order of their first value) and how they interact.

    ``couplings``: values read across groups that backward need not read (see the module text).
    ``classes``: group indices with one signature; the first of each is its representative.
    """

    problem: Problem
    groups: tuple[Group, ...]
    group_of: Mapping[int, int]
    couplings: frozenset[int]
    classes: tuple[tuple[int, ...], ...]
    class_of: tuple[int, ...]

    def block_classes(self) -> list[list[str]]:
        """Names of the block groups, one list per set of identical blocks."""
        return [[self.groups[g].name for g in members] for members in self.classes if self.groups[members[0]].is_block]

    def span(self, value: int) -> tuple[int, int]:
        """First and last group (by index) that make or read the coupling ``value``."""
        touching = [g for g, group in enumerate(self.groups) if value in group.touched]
        return min(touching), max(touching)


def decompose(problem: Problem, *, blocks: bool = True) -> Decomposition:
    """Group ``problem``'s relevant values; ``blocks=False`` gives one group holding everything."""
    relevant = relevant_values(problem)
    names = _assign(problem, relevant) if blocks else {v: f"{REST} 0" for v in relevant}
    members: dict[str, list[int]] = defaultdict(list)
    for v in sorted(relevant):
        members[names[v]].append(v)
    ordered = sorted(members, key=lambda name: members[name][0])
    index = {name: i for i, name in enumerate(ordered)}
    group_of = {v: index[names[v]] for v in relevant}
    couplings = _couplings(problem, relevant, group_of)
    recomputable = effectively_recomputable(problem)
    groups = []
    for name in ordered:
        ids = tuple(members[name])
        touched, signature = _signature(problem, ids, index[name], group_of, couplings, recomputable)
        groups.append(Group(name, ids, not name.startswith(REST), touched, signature))
    by_signature: dict[Hashable, list[int]] = defaultdict(list)
    for g, group in enumerate(groups):
        by_signature[(group.is_block, group.signature)].append(g)
    classes = tuple(tuple(gs) for gs in sorted(by_signature.values()))
    class_of = [0] * len(groups)
    for c, gs in enumerate(classes):
        for g in gs:
            class_of[g] = c
    return Decomposition(problem, tuple(groups), group_of, couplings, classes, tuple(class_of))


def _assign(problem: Problem, relevant: frozenset[int]) -> dict[int, str]:
    """Group name of every relevant value (see the module text for the rules)."""
    values, sizes = problem.values, problem.storage_bytes
    storage_group: dict[int, str] = {}
    names: dict[int, str] = {}
    block_firsts: list[int] = []
    seen_blocks: set[str] = set()
    for v in sorted(relevant):
        value = values[v]
        nbytes = sizes[value.storage]
        name = storage_group.get(value.storage) if nbytes > 0 else None
        if name is None:
            name = block_of(value.module) if value.module else None
            if name is None and not value.module:
                sources = {names[u] for u in value.inputs if u in names}
                if len(sources) == 1 and not next(iter(sources)).startswith(REST):
                    name = next(iter(sources))
        if name is None:
            name = REST  # placed in a stretch below, once every block's start is known
        elif name != REST and name not in seen_blocks:
            seen_blocks.add(name)
            block_firsts.append(v)
        if nbytes > 0:
            storage_group.setdefault(value.storage, name)
        names[v] = name
    # Rest values take the stretch they fall in: before the first block, between blocks, after the last.
    for v, name in names.items():
        if name == REST:
            names[v] = f"{REST} {sum(1 for first in block_firsts if first < v)}"
    # A storage first made in the rest keeps its views in the same stretch.
    first_of: dict[int, int] = {}
    for v in sorted(relevant):
        storage = values[v].storage
        if sizes[storage] > 0:
            names[v] = names[first_of.setdefault(storage, v)]
    return names


def _couplings(problem: Problem, relevant: frozenset[int], group_of: Mapping[int, int]) -> frozenset[int]:
    """Values read by another group that backward does not read itself."""
    found = set()
    for w in relevant:
        for u in problem.values[w].inputs:
            if u in relevant and group_of[u] != group_of[w] and u not in problem.backward_reads:
                found.add(u)
    return frozenset(found)


def _signature(problem: Problem, members: tuple[int, ...], group: int, group_of: Mapping[int, int],
               couplings: frozenset[int], recomputable: tuple[bool, ...]) -> tuple[tuple[int, ...], Hashable]:
    """The coupling values the group touches (canonical order) and its structural signature."""
    values, sizes = problem.values, problem.storage_bytes
    position = {v: k for k, v in enumerate(members)}
    touched: list[int] = []
    storage_slot: dict[int, int] = {}
    rows = []
    for k, v in enumerate(members):
        value = values[v]
        inputs = []
        for u in value.inputs:
            if u in position:
                inputs.append(("L", position[u]))
            elif u in couplings and group_of.get(u) != group:
                if u not in touched:
                    touched.append(u)
                inputs.append(("C", touched.index(u)))
            else:
                # Available, or read by backward (present in every plan, paid for by its own group):
                # either way free here, so the two look alike.
                inputs.append(("F",))
        coupling_out = -1
        if v in couplings:
            touched.append(v)
            coupling_out = len(touched) - 1
        nbytes = sizes[value.storage]
        slot = storage_slot.setdefault(value.storage, k) if nbytes > 0 else -1
        rows.append((
            value.op, tuple(sorted(value.tags)), value.recompute_seconds, value.flops, nbytes, slot,
            value.keepable, recomputable[v], v in problem.backward_reads, coupling_out, tuple(inputs),
        ))
    return tuple(touched), tuple(rows)


__all__ = ["Decomposition", "Group", "REST", "decompose"]
