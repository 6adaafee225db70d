"""Stamp the Problem of a shallow trace of a block stack out to the full depth, without tracing it.

A decoder of ``n`` identical blocks gives a Problem whose values, storages and backward steps
repeat block by block. ``stamp_problem`` takes the Problem of the same model traced with its
first ``K`` blocks only (``K >= 3``: a first block, a middle one, a last one) and writes the
Problem of ``n`` blocks: blocks ``0 .. K-3`` as traced, block ``K-2`` (the last middle block)
repeated as blocks ``K-2 .. n-2``, block ``K-1`` as block ``n-1``; everything outside the stack
(embeddings, final norm, loss, the parameters' placeholders of other modules) as traced.

What a block is comes from the caller (``BlockLabels``: the block index of every value and
backward step, ``None`` outside the stack). References are renumbered relative to the block
that makes them: a middle block reads its own values and its predecessor's (at the same
position in the predecessor's run), the last block its own and the last middle one's, values
outside the stack the first blocks' or the last one's. Anything else (a block reading two
blocks back, code outside the stack reading a middle block, blocks whose runs are not in block
order) raises ``StampRefused``: the caller traces the whole model instead. Names of values in
renumbered blocks get a ``.L<block>`` suffix (FX numbers its nodes graph-wide; a stamped graph
has no FX names), so two Problems are compared ``without_names``.

Torch-free: it reads and writes ``solvers.problem`` records only.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Iterator, Sequence

from remat_pass.solvers.problem import Problem, Value

_PRIMALS = "primals_"
# A real tensor a forward makes from Python (HF GPT-2's eager attention: the mask value) is lifted
# into the graph as ``_tensor_constant0, 1, ...``, numbered in graph order like the primals.
_CONSTANTS = "_tensor_constant"
Slot = tuple[int, int, int]  # (group of runs, block, position in the block's run)


class StampRefused(ValueError):
    """The traced Problem is not a stack of blocks ``stamp_problem`` can repeat; says why."""


@dataclass(frozen=True)
class BlockLabels:
    """The block index of every value and every backward step of a traced Problem (None: outside the stack)."""

    values: tuple[int | None, ...]
    steps: tuple[int | None, ...]


@dataclass(frozen=True)
class _Runs:
    """One sequence (values or steps) cut into runs of one label; blocks' runs grouped."""

    runs: tuple[tuple[int | None, int, int], ...]  # (label, start, end)
    group_of_run: tuple[int | None, ...]
    slot: dict[int, Slot]  # index in the sequence -> slot
    at: dict[Slot, int]


def _cut(labels: Sequence[int | None], traced: int, descending: bool) -> _Runs:
    runs: list[tuple[int | None, int, int]] = []
    for index, label in enumerate(labels):
        if runs and runs[-1][0] == label:
            runs[-1] = (label, runs[-1][1], index + 1)
        else:
            runs.append((label, index, index + 1))
    expected = list(range(traced))[::-1] if descending else list(range(traced))
    groups: list[int | None] = []
    slot: dict[int, Slot] = {}
    group, seen = -1, []
    for label, start, end in runs:
        if label is None:
            if seen and seen != expected:
                raise StampRefused(f"blocks' runs {seen} are not in block order {expected}")
            seen = []
            groups.append(None)
            continue
        if seen and (label >= seen[-1] if descending else label <= seen[-1]):  # the blocks start again
            if seen != expected:
                raise StampRefused(f"blocks' runs {seen} are not in block order {expected}")
            seen = []
        if not seen:
            group += 1
        seen.append(label)
        groups.append(group)
        slot.update((index, (group, label, index - start)) for index in range(start, end))
    if seen and seen != expected:
        raise StampRefused(f"blocks' runs {seen} are not in block order {expected}")
    return _Runs(tuple(runs), tuple(groups), slot, {s: i for i, s in slot.items()})


class _Stamper:
    """The renumbering for ``traced`` blocks stamped to ``depth``: block ``K-2`` is the template."""

    def __init__(self, traced: int, depth: int, stack_path: str) -> None:
        if traced < 3 or depth < traced:
            raise StampRefused(f"need at least 3 traced blocks and depth >= traced, got {traced} -> {depth}")
        self.traced, self.depth = traced, depth
        self.template, self.last = traced - 2, traced - 1
        self._stack = stack_path
        self._path = re.compile(r"(^|\.)" + re.escape(stack_path) + r"\.(\d+)(?=\.|$)")

    def outputs(self, label: int | None) -> list[int | None]:
        """The blocks one traced block's run is emitted as, in forward order."""
        if label is None:
            return [None]
        if label < self.template:
            return [label]
        if label == self.template:
            return list(range(self.template, self.depth - 1))
        return [self.depth - 1]

    def source(self, block: int) -> int:
        """The traced block whose run stands for output ``block``."""
        if block < self.template:
            return block
        return self.template if block < self.depth - 1 else self.last

    def target(self, context: int | None, block: int | None, label: int) -> int:
        """The output block that a reference to traced block ``label`` means, from a run of traced
        block ``context`` emitted as output ``block`` (None, None: outside the stack)."""
        if context is None or context < self.template:
            if label < self.template and (context is None or label <= context):
                return label
            if context is None and label == self.last:
                return self.depth - 1
        elif label in (context - 1, context):
            return block + label - context
        raise StampRefused(f"a reference from block {context} to block {label} cannot be repeated")

    def module(self, path: str, block: int | None) -> str:
        """``path`` with the stack's block index set to ``block``."""
        return path if block is None else self._path.sub(lambda m: f"{m.group(1)}{self._stack}.{block}", path)


def _emission(runs: _Runs, stamper: _Stamper, descending: bool) -> Iterator[tuple[int, int | None, int | None]]:
    """(old index, traced block, output block) in the order the stamped sequence holds them."""
    for label, start, end in runs.runs:
        blocks = stamper.outputs(label)
        for block in (blocks[::-1] if descending else blocks):
            for index in range(start, end):
                yield index, label, block


def stamp_problem(problem: Problem, labels: BlockLabels, traced: int, depth: int, stack_path: str) -> Problem:
    """The Problem of ``depth`` blocks from ``problem``, traced with ``traced`` blocks (see the module)."""
    stamper = _Stamper(traced, depth, stack_path)
    if len(labels.values) != len(problem.values) or len(labels.steps) != len(problem.backward_steps):
        raise StampRefused("labels do not match the problem")
    vruns = _cut(labels.values, traced, descending=False)
    sruns = _cut(labels.steps, traced, descending=True)
    _check_template_runs(vruns, stamper)
    _check_template_runs(sruns, stamper)
    maker: dict[int, int] = {}
    for value in problem.values:
        maker.setdefault(value.storage, value.id)
    new_id: dict[tuple[int, int | None], int] = {}
    values: list[Value] = []
    storage_bytes: list[int] = [problem.storage_bytes[0]] if problem.storage_bytes else []

    def resolve(old: int, context: int | None, block: int | None) -> int:
        slot = vruns.slot.get(old)
        if slot is None:
            key = (old, None)
        else:
            group, label, position = slot
            out = stamper.target(context, block, label)
            source = vruns.at.get((group, stamper.source(out), position))
            if source is None:
                raise StampRefused(f"value {problem.values[old].name} has no counterpart in block {out}")
            key = (source, out)
        if key not in new_id:
            raise StampRefused(f"value {problem.values[old].name} is read before it is made")
        return new_id[key]

    for old, label, block in _emission(vruns, stamper, descending=False):
        value = problem.values[old]
        made_by = maker[value.storage]
        if value.storage == 0:
            storage = 0
        elif made_by == old:
            storage = len(storage_bytes)
            storage_bytes.append(problem.storage_bytes[value.storage])
        else:
            storage = values[resolve(made_by, label, block)].storage
        ident = len(values)
        new_id[(old, block)] = ident
        values.append(dataclasses.replace(
            value, id=ident, inputs=tuple(resolve(i, label, block) for i in value.inputs), storage=storage,
            name=value.name if block == label else f"{value.name}.L{block}", module=stamper.module(value.module, block)))
    values = _renumber(problem.values, _renumber(problem.values, values, _PRIMALS, 1), _CONSTANTS, 0)
    origin = {ident: old for (old, _), ident in new_id.items()}
    steps = [dataclasses.replace(step, reads=tuple(sorted(resolve(r, label, block) for r in step.reads)))
             for old, label, block in _emission(sruns, stamper, descending=True)
             for step in (problem.backward_steps[old],)]
    return dataclasses.replace(
        problem, values=tuple(values), storage_bytes=tuple(storage_bytes), backward_steps=tuple(steps),
        backward_reads=frozenset(i for i, old in origin.items() if old in problem.backward_reads),
        forward_outputs=frozenset(i for i, old in origin.items() if old in problem.forward_outputs))


def _check_template_runs(runs: _Runs, stamper: _Stamper) -> None:
    """A middle block reads its predecessor at the same positions: their runs must be as long."""
    lengths: dict[tuple[int, int], int] = {}
    for (label, start, end), group in zip(runs.runs, runs.group_of_run):
        if label is not None and group is not None:
            lengths[(group, label)] = end - start
    for (group, label), length in lengths.items():
        if label == stamper.template and lengths.get((group, label - 1)) != length:
            raise StampRefused(f"block {label}'s run ({length}) and block {label - 1}'s differ in length")


def _renumber(traced: Sequence[Value], stamped: list[Value], prefix: str, first: int) -> list[Value]:
    """AOTAutograd's inputs are ``primals_1, primals_2, ...`` in graph order (name and op), lifted
    constants ``_tensor_constant0, ...``: number the stamped ones the same way, where the traced
    ones are."""
    numbered = [v for v in traced if v.available and v.op.startswith(prefix)]
    if [v.op for v in numbered] != [f"{prefix}{i}" for i in range(first, len(numbered) + first)]:
        return stamped
    count = first
    for index, value in enumerate(stamped):
        if value.available and value.op.startswith(prefix):
            stamped[index] = dataclasses.replace(value, name=f"{prefix}{count}", op=f"{prefix}{count}")
            count += 1
    return stamped


def without_names(problem: Problem) -> Problem:
    """``problem`` with every value's name blanked: what a stamped and a traced Problem share."""
    return dataclasses.replace(problem, values=tuple(dataclasses.replace(v, name="") for v in problem.values))


__all__ = ["BlockLabels", "StampRefused", "stamp_problem", "without_names"]
