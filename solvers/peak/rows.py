"""The peak budget as rows of the keep/recompute ILP: one per backward interval, all valid.

Under the just-in-time schedule (``solvers.analysis.memory``) some storages are alive at backward step
``t`` in *every* plan that makes a given choice, whatever else it does:

* a kept value whose last direct backward read is at or after ``t`` (kept from the forward
  until its last use);
* a recomputed value whose direct reads span ``t`` (materialized no later than its first read,
  freed no earlier than its last);

and at the forward's end every kept storage is alive.

Those storages, the step's plan-independent working set and the step's outputs (held to the
end) must fit the budget. Every real plan that fits satisfies these rows, so the ILP under them
is a *relaxation*: its optimum, with storages rounded down and the room rounded up, is a proven
lower bound on the least recompute time of any plan whose simulated peak fits. What the rows
leave out is what a plan adds on top: a chain recomputed early and held until its values' own
reads, a kept value that a later recomputation still reads, the transient of a replayed
dropout. A plan the ILP returns is simulated; when that overshoots, the rows are tightened by
the overshoot (no longer a relaxation: the bound stays the first one).

The term sets change only where some value's first or last read is, so one row per interval
between such steps (at its largest working set) is as strong as one per step.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import pulp

from ..mip.solve import MipResult, add_row, fraction
from ..mip.cpsat import implied_integral
from ..mip.keep_model import Model, Rounding, plan_from
from ..analysis.memory import working_while_making
from ..analysis.lifetimes import backward_steps_of, read_spans
from ..problem import Plan, Problem


@dataclass(frozen=True)
class _Interval:
    """Steps ``[start, end)`` with the same terms; ``working``: their largest working set."""

    start: int
    end: int
    working: int


def _intervals(problem: Problem, first: dict[int, int], last: dict[int, int]) -> list[_Interval]:
    steps = backward_steps_of(problem)
    cuts = sorted({0, len(steps)} | set(first.values()) | {t + 1 for t in last.values()})
    found = []
    for start, end in zip(cuts, cuts[1:]):
        if start < end:
            found.append(_Interval(start, end, max(s.working_bytes for s in steps[start:end])))
    return found


@dataclass(frozen=True)
class _StorageReads:
    """One storage backward reads: its size in model units, per value living in it ``(first read,
    last read, keep variable, recompute variable)``, and, with ``kept_readers``, its paid variable
    and the last step a kept copy may serve (``kept_until``)."""

    storage: int
    size: int
    members: tuple[tuple[int, int, pulp.LpVariable | None, pulp.LpVariable | None], ...]
    paid: pulp.LpVariable | None
    paid_until: int

    @property
    def horizon(self) -> int:
        """The last step at which any of its literals can be alive."""
        return max([last for _, last, _, _ in self.members] + [self.paid_until if self.paid is not None else -1])

    def alive_at(self, t: int) -> list[tuple[pulp.LpVariable, ...]]:
        """What makes the storage alive at step ``t`` for sure, one literal per tuple (a sum of its
        variables): a value kept and read at or after ``t``, or recomputed and read around ``t``.
        Where both apply the literal is ``k_v + r_v``: a plan does one or the other, and backward's
        read makes it do one, so the LP relaxation cannot pay half of each (with two literals it
        could claim the storage half alive). With ``kept_readers``, ``g_s`` while a kept copy may serve."""
        alive = []
        for first, last, keep, recompute in self.members:
            if last < t:
                continue
            literal = tuple(variable for variable in (keep, recompute if first <= t else None) if variable is not None)
            if literal:
                alive.append(literal)
        if self.paid is not None and self.paid_until >= t:
            alive.append((self.paid,))
        return alive


@dataclass(frozen=True)
class _ReadStorages:
    """The storages of a model's rows, found by step: only those alive at or after a step can be in its row."""

    storages: tuple[_StorageReads, ...]
    by_horizon: tuple[int, ...]  # indexes into ``storages``, by horizon
    horizons: tuple[int, ...]  # their horizons, ascending

    @classmethod
    def of(cls, storages: list[_StorageReads]) -> _ReadStorages:
        order = sorted(range(len(storages)), key=lambda i: storages[i].horizon)
        return cls(tuple(storages), tuple(order), tuple(storages[i].horizon for i in order))

    def at(self, t: int) -> list[_StorageReads]:
        """The storages whose literals may be alive at step ``t``, in their original order (the rows'
        terms keep one order, so the model is the same whichever steps it has rows at)."""
        return [self.storages[i] for i in sorted(self.by_horizon[bisect_left(self.horizons, t):])]


@dataclass(frozen=True)
class Cut:
    """``storage`` is alive at backward step ``step`` in every plan that makes all ``literals``
    true (("k", v): v kept, ("r", v): v recomputed); found where a simulated plan overshoots."""

    step: int
    storage: int
    literals: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class PeakRows:
    """A ``ModelExtension`` for ``solve_once``: the valid peak rows at ``budget_bytes - margin``.

    ``rounding`` must be the model's; with ``margin`` 0 and optimistic rounding the model is a
    relaxation of the peak-budget problem (its bound is a lower bound), with conservative
    rounding its plans satisfy every row in exact bytes. ``cuts`` add rows at their steps.
    """

    problem: Problem
    budget_bytes: int
    rounding: Rounding
    margin: int = 0
    cuts: tuple[Cut, ...] = ()
    # Add, in a row of their own ("make"), the inputs alive while a value first read at the step is
    # made (not valid: no bound). They die before the step's op runs, so that row has the previous
    # step's working set less its scratch, as ``memory.simulate_plan`` does, not the op's.
    transients: bool = False
    # Count a kept storage alive until the last recomputation that may read it, not only its
    # last direct read (not valid: no bound; see ``kept_until``).
    kept_readers: bool = False
    # Backward steps whose rows are left out (not valid: no bound): the tied copies' steps, which
    # the representative copy's rows imply once identical blocks are tied (``mirrored_blocks``).
    skipped_steps: frozenset[int] = frozenset()

    def add(self, model: Model) -> None:
        problem, lp = self.problem, model.lp
        first, last = read_spans(problem)
        pinned = {problem.values[i].storage for i in problem.forward_outputs}
        pinned_bytes = sum(problem.storage_bytes[s] for s in pinned)
        readable = _ReadStorages.of(self._storage_reads(model, first, last, pinned))
        steps = backward_steps_of(problem)
        rows = [(f"i{index}", interval.start, interval.working) for index, interval in
                enumerate(_intervals(problem, first, last))
                if not all(t in self.skipped_steps for t in range(interval.start, interval.end))]
        rows += [(f"c{t}", t, steps[t].working_bytes) for t in sorted({cut.step for cut in self.cuts})]
        room = self.budget_bytes - self.margin - pinned_bytes
        first_read_at: dict[int, list[int]] = {}
        for v, t in first.items():
            first_read_at.setdefault(t, []).append(v)
        either: dict[tuple, pulp.LpVariable] = {}
        for name, t, working in rows:
            coefficients: dict[pulp.LpVariable, int] = {}
            for reads in readable.at(t):
                self._pay_alive(model, reads, name, t, coefficients, either)
            if name.startswith("c"):
                coefficients.update(self._cut_terms(model, t))
            if coefficients:
                add_row(lp, coefficients, pulp.LpConstraintLE, self._room_units(room - working), f"peak{name}")
            if self.transients:  # alive while a value is made: before the op's own working set exists
                made = self._transient_terms(model, name, first_read_at.get(t, []), last)
                if made is not None:
                    making = self._room_units(room - working_while_making(steps, t))
                    add_row(lp, {**coefficients, made: 1}, pulp.LpConstraintLE, making, f"make{name}")
        # The forward's end: every kept storage and the outputs are alive together.
        kept = {g: units for s, g in model.paid.items() if s not in pinned and (units := self._units(problem.storage_bytes[s]))}
        if kept:
            add_row(lp, kept, pulp.LpConstraintLE, self._room_units(self.budget_bytes - self.margin - pinned_bytes),
                    "peak_forward")

    def _storage_reads(self, model: Model, first: dict[int, int], last: dict[int, int],
                       pinned: set[int]) -> list[_StorageReads]:
        """Per storage that backward reads (or, with ``kept_readers``, that a kept copy serves), the
        values that can make it alive, with the variables of their literals."""
        problem, values = self.problem, self.problem.values
        members: dict[int, list[int]] = {}
        for v in last:
            storage = values[v].storage
            if problem.storage_bytes[storage] > 0 and storage not in pinned:
                members.setdefault(storage, []).append(v)
        until = kept_until(problem, first, last) if self.kept_readers else {}
        for storage in until:
            if storage in model.paid and storage not in pinned:
                members.setdefault(storage, [])
        return [_StorageReads(storage, self._units(problem.storage_bytes[storage]),
                              tuple((first[v], last[v], model.keep.get(v), model.recompute.get(v)) for v in vs),
                              model.paid[storage] if storage in model.paid and storage in until else None,
                              until.get(storage, -1))
                for storage, vs in members.items()]

    @staticmethod
    def _pay_alive(model: Model, reads: _StorageReads, row: str, t: int, coefficients: dict[pulp.LpVariable, int],
                   either: dict[tuple, pulp.LpVariable]) -> None:
        """The storage's size on what makes it alive at step ``t`` for sure (``_StorageReads.alive_at``).
        Views of one storage are paid once however many are alive, through a variable above each of
        their literals, one per storage and set of literals (``either``), shared by every row with that
        set: only its literals bound it from below, and the peak rows hold it with a positive size, so
        it can always be lowered to their max; one per row is no tighter. A 12-layer GPT's untied rows
        need 450 of them, not 50,000, and 3,700 rows, not 109,000."""
        alive = reads.alive_at(t)
        if not alive:
            return
        if len(alive) == 1 and len(alive[0]) == 1:
            if reads.size:  # rounded down to no units: no term
                coefficients[alive[0][0]] = reads.size
            return
        key = (reads.storage, tuple(tuple(variable.name for variable in literal) for literal in alive))
        if key not in either:
            name = f"alive{row}_{reads.storage}"  # named by the first row that needs it
            either[key] = above = fraction(model.lp, name)
            for index, literal in enumerate(alive):
                add_row(model.lp, {above: 1, **{variable: -1 for variable in literal}}, pulp.LpConstraintGE, 0,
                        f"{name}_{index}")
        if reads.size:
            coefficients[either[key]] = reads.size

    def _transient_terms(self, model: Model, name: str, made: list[int],
                         last: dict[int, int]) -> pulp.LpVariable | None:
        """The largest set of recomputed inputs without backward reads of their own alive while
        one value first read at this step is made (they die right after, so no valid row sees
        them, yet they add to the step's peak: attention scores before the softmax)."""
        lp, values, sizes = model.lp, self.problem.values, self.problem.storage_bytes
        largest = None
        for w in made:
            if w not in model.recompute:
                continue
            terms = []
            for u in sorted(set(values[w].inputs)):
                if u in last or u not in model.recompute or sizes[values[u].storage] == 0:
                    continue
                both = fraction(lp, f"made{name}_{w}_{u}")
                lp += both >= model.recompute[w] + model.recompute[u] - 1, f"made{name}_{w}_{u}"
                terms.append(self._units(sizes[values[u].storage]) * both)
            if terms:
                largest = largest if largest is not None else _units_variable(lp, f"made{name}")
                lp += largest >= pulp.lpSum(terms), f"made{name}_{w}"
        return largest

    def _cut_terms(self, model: Model, step: int) -> dict[pulp.LpVariable, int]:
        terms, lp = {}, model.lp
        for index, cut in enumerate(c for c in self.cuts if c.step == step):
            variables = [(model.keep if kind == "k" else model.recompute).get(v) for kind, v in cut.literals]
            if any(variable is None for variable in variables):
                continue  # a choice the model does not offer: the cut never applies
            together = fraction(lp, f"cut{step}_{index}")
            lp += together >= pulp.lpSum(variables) - (len(variables) - 1), f"cut{step}_{index}"
            if units := self._units(self.problem.storage_bytes[cut.storage]):
                terms[together] = units
        return terms

    def _units(self, nbytes: int) -> int:
        q = self.rounding.quantum
        return -(-nbytes // q) if self.rounding.up else nbytes // q

    def _room_units(self, nbytes: int) -> int:
        q = self.rounding.quantum
        nbytes = max(nbytes, 0)
        return nbytes // q if self.rounding.up else -(-nbytes // q)

    def plan_from(self, problem: Problem, model: Model, result: MipResult, **fields: object) -> Plan:
        return plan_from(problem, model, result, **fields)


def kept_until(problem: Problem, first: dict[int, int], last: dict[int, int]) -> dict[int, int]:
    """Per storage, the last backward step at which a kept copy of it may still be read: by a
    backward step directly, or to recompute a value from it (a held recomputation is made by
    its first read at the latest). The rows by direct reads alone miss a storage kept only for
    what is rebuilt from it (the attention output kept for its views, a matmul output kept for
    its reshapes): on the Llama-style model their plans peaked 36% over the budget, the cut
    rounds did not recover, and the search fell back to plans needing 45% more FLOPs.
    Not valid for the bound: a recomputation may happen earlier than the first read."""
    values, users = problem.values, problem.users
    needed_until: dict[int, int] = {}
    for v in reversed(range(len(values))):
        if values[v].available:
            continue
        step = last.get(v, -1)
        for w in users[v]:
            step = max(step, first[w] if w in first else needed_until.get(w, -1))
        needed_until[v] = step
    found: dict[int, int] = {}
    for v, step in needed_until.items():
        storage = values[v].storage
        if step >= 0 and problem.storage_bytes[storage] > 0:
            found[storage] = max(found.get(storage, -1), step)
    return found


def _units_variable(lp: pulp.LpProblem, name: str) -> pulp.LpVariable:
    """A continuous variable >= 0 (byte units) owned by ``lp``: bounded below by sums of whole
    units only, so a whole number of units is always as good (``cpsat.implied_integral``)."""
    if hasattr(lp, "add_variable"):
        return implied_integral(lp, lp.add_variable(name, 0, None, cat=pulp.LpContinuous))
    return implied_integral(lp, pulp.LpVariable(name, lowBound=0))


def cuts_at(problem: Problem, plan: Plan, step: int, alive: set[int]) -> list[Cut]:
    """Valid cuts explaining storages the rows missed at ``step`` where ``plan`` overshoots.

    A recomputed value read only after ``step`` is alive there when a chain of recomputed
    values leads from it to one read at or before ``step`` (materializing that one needs it);
    a kept value last read before ``step`` is alive there when a recomputed reader of it
    cannot be needed before a later step. Only storages of a single read value are cut (a
    storage shared by views would be counted twice).
    """
    values = problem.values
    first, last = read_spans(problem)
    members: dict[int, list[int]] = {}
    for v in last:
        members.setdefault(values[v].storage, []).append(v)
    users = problem.users
    earliest = earliest_need(problem, first)
    found = []
    for storage in sorted(alive):
        if len(members.get(storage, ())) != 1:
            continue
        (v,) = members[storage]
        if v in plan.recomputed and first[v] > step and last[v] >= step:
            path = _recomputed_path(problem, plan, v, lambda w: first.get(w, step + 1) <= step)
            if path:
                found.append(Cut(step, storage, tuple(("r", w) for w in path)))
        elif v in plan.kept and last[v] < step:
            reader = next((w for w in users[v] if w in plan.recomputed and earliest[w] > step), None)
            if reader is not None:
                found.append(Cut(step, storage, (("k", v), ("r", reader))))
    return found


def earliest_need(problem: Problem, first: dict[int, int]) -> list[int]:
    """For each value, the first backward step reading it or any value computed from it:
    no plan materializes it, or uses it to materialize another, before then."""
    never = len(backward_steps_of(problem)) + 1
    earliest = [first.get(v.id, never) for v in problem.values]
    users = problem.users
    for v in reversed(range(len(problem.values))):
        for w in users[v]:
            earliest[v] = min(earliest[v], earliest[w])
    return earliest


def _recomputed_path(problem: Problem, plan: Plan, start: int, needed: object) -> list[int]:
    """A path start -> ... -> w of recomputed values whose end satisfies ``needed`` (BFS)."""
    users = problem.users
    parent: dict[int, int | None] = {start: None}
    queue = [start]
    for v in queue:
        if v != start and needed(v):  # type: ignore[operator]
            path = [v]
            while parent[path[-1]] is not None:
                path.append(parent[path[-1]])  # type: ignore[arg-type]
            return path[::-1]
        for w in users[v]:
            if w in plan.recomputed and w not in parent:
                parent[w] = v
                queue.append(w)
    return []
