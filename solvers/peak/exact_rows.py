"""Peak rows that follow the just-in-time schedule exactly at chosen backward steps.

``rows``' valid rows see a value alive only where its own direct backward reads put it.
What they miss is what makes real plans overshoot them: a recomputed value is materialized
before the first step that needs it *directly or through another recomputed value* (a chain
rebuilt early is held until its own reads), and a kept value stays alive until the last
recomputation that reads it, which may be long after its last direct read (a kept ``clone``
whose recomputed view backward reads near its end). On the h64 GPT-style model the relaxation
of the plain rows claimed plans at 0.40x per-block checkpointing's recompute time that peaked
55% over the budget.

At a step ``t`` this module models the schedule's state exactly. For each value that may be
recomputed, ``m_v`` ("made by ``t``") is

    m_v = r_v and (first direct read of v <= t, or m_w for some recomputed user w of v,
                   or m of its tuple when v is a tuple's element: the rewrite unpacks it then),

linearized with both directions (``m_v >= r_v`` when read by ``t``, ``m_v >= m_w + r_v - 1``;
``m_v <= r_v``, ``m_v <= sum of its reasons`` when not yet read): with binary keep/recompute
choices ``m`` is forced to its true value. The storages alive at step ``t``'s op are then those
of

* a value kept, or made by ``t``, and read directly at or after ``t`` (one literal
  ``k_v + m_v``: a plan does one or the other);
* a value kept, or made by ``t``, with a recomputed reader not made by ``t`` that is still
  needed at or after ``t`` (``k_u + r_w - 1 - m_w``): it lives until that reader is made.

That is the simulator's set at the op, less what the model leaves out (a second tensor of a kept
storage), so every plan that fits satisfies these rows: the model stays a relaxation, and its
bound a proven lower bound, only tighter. Rows of the same kind are placed at the moment a
value is made for a step (the previous step's working set is still there) and after a forward
value. Each step adds a variable per value, so rows are added lazily, at the places where the
relaxation's plan peaks (``ExactRowPlaces``, used by ``solvers.peak.planner``).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import pulp

from ..mip.solve import backend_works, fraction, resolve_backend
from ..mip.keep_model import Model, Rounding
from ..analysis.memory import PlanMemory, working_while_making
from ..analysis.lifetimes import backward_lifetimes, backward_steps_of, forward_computed, read_spans
from .rows import PeakRows, earliest_need
from ..problem import Plan, Problem
from ..tags import Tag

logger = logging.getLogger(__name__)


def latest_need(problem: Problem, last: dict[int, int]) -> list[int]:
    """For each value, the last backward step reading it or any value computed from it (-1: none):
    no plan needs it, to read or to rebuild another, after then."""
    values, users = problem.values, problem.users
    latest = [last.get(v, -1) for v in range(len(values))]
    for v in reversed(range(len(values))):
        for w in users[v]:
            latest[v] = max(latest[v], latest[w])
    return latest


@dataclass(frozen=True)
class ExactStepRows(PeakRows):
    """``PeakRows``' valid rows, plus exact rows at backward ``steps``, ``events`` and ``forward_at``.

    Use with the model's optimistic rounding and no margin for a relaxation (``PeakRows``).
    """

    steps: tuple[int, ...] = ()
    # (step, value): an exact row at the moment ``value`` is made for ``step`` (see ``_event_row``)
    events: tuple[tuple[int, int], ...] = ()
    forward_at: tuple[int, ...] = ()  # forward values: a row at each (see ``_forward_row``)

    def add(self, model: Model) -> None:
        PeakRows.add(self, model)
        first, last = read_spans(self.problem)
        earliest = earliest_need(self.problem, first)
        for v in self.problem.values:  # an element of a recomputed tuple is made with the tuple
            if _tuple_of(self.problem, v.id) is not None:
                earliest[v.id] = min(earliest[v.id], earliest[v.inputs[0]])
        latest = latest_need(self.problem, last)
        made: dict[int, dict[int, pulp.LpVariable]] = {}

        def made_by(step: int) -> dict[int, pulp.LpVariable]:
            if step not in made:
                made[step] = self._made_by(model, step, first, earliest, latest) if step >= 0 else {}
            return made[step]

        for step in sorted(set(self.steps)):
            self._row(model, step, made_by(step), first, last, latest)
        for step, value in sorted(set(self.events)):
            if value in made_by(step):
                self._event_row(model, step, value, made_by(step), made_by(step - 1), first, last, latest)
        for value in sorted(set(self.forward_at)):
            self._forward_row(model, value)

    def _made_by(self, model: Model, step: int, first: dict[int, int], earliest: list[int],
                 latest: list[int]) -> dict[int, pulp.LpVariable]:
        """``m_v`` at ``step`` for each value that may be recomputed and still matters then."""
        lp, users = model.lp, self.problem.users
        made = {v: fraction(lp, f"x{step}_m{v}") for v in sorted(model.recompute)
                if earliest[v] <= step <= latest[v]}

        def made_term(w: int) -> object:
            """m_w at ``step``: a reader needed only before ``step`` is made iff recomputed."""
            if w in made:
                return made[w]
            return model.recompute[w] if w in model.recompute and latest[w] < step else 0

        def needed_alone(g: int) -> object:
            """Whether tuple element ``g`` is needed by ``step`` for itself (read, or a recomputed
            reader made), as a variable <= r_g: only such a need makes its tuple."""
            nonlocal lp
            if g not in model.recompute:
                return 0
            read = [model.recompute[g]] if first.get(g, step + 1) <= step else []
            need = fraction(lp, f"x{step}_n{g}")
            lp += need <= model.recompute[g], f"x{step}_nr{g}"
            lp += need <= pulp.lpSum(read + [made_term(w) for w in sorted(set(users[g]))]), f"x{step}_nu{g}"
            return need

        for v, m in made.items():
            r = model.recompute[v]
            whole = _tuple_of(self.problem, v)
            # An element's reasons count for its tuple directly, not through the element's m:
            # the element is also made *because* the tuple is, and m_tuple <= m_element <= m_tuple
            # would let both claim to be made for no reason.
            reasons = [needed_alone(w) if _tuple_of(self.problem, w) == v else made_term(w)
                       for w in sorted(set(users[v]))]
            makers = [made_term(w) for w in sorted(set(users[v]))]
            if whole is not None:  # the rewrite unpacks a recomputed tuple when it makes it
                reasons.append(made_term(whole))
                makers.append(made_term(whole))
            lp += m <= r, f"x{step}_mr{v}"
            if first.get(v, step + 1) <= step:
                lp += m >= r, f"x{step}_md{v}"
            else:
                lp += m <= pulp.lpSum(reasons), f"x{step}_mu{v}"
            for index, maker in enumerate(makers):
                if not isinstance(maker, int):
                    lp += m >= maker + r - 1, f"x{step}_mc{v}_{index}"
        return made

    def _row(self, model: Model, step: int, made: dict[int, pulp.LpVariable], first: dict[int, int],
             last: dict[int, int], latest: list[int]) -> None:
        """The storages alive while step ``step``'s op runs, with its working set."""
        alive = self._alive(model, step, made, made, first, last, latest)
        working = backward_steps_of(self.problem)[step].working_bytes
        self._emit(model, f"x{step}", alive, working)

    def _event_row(self, model: Model, step: int, value: int, made: dict[int, pulp.LpVariable],
                   made_before: dict[int, pulp.LpVariable], first: dict[int, int], last: dict[int, int],
                   latest: list[int]) -> None:
        """The moment ``value`` is made for ``step``: the previous step's working set (less its
        scratch) is still there, with ``value``'s inputs and its own transient.

        ``d = m_value(step) - m_value(step - 1)`` is 1 exactly when it is made then. Alive for sure
        at that moment: what is alive at both ops around it, and ``value`` and its inputs when d is
        1. With d 0 the row asks less than step ``step``'s op row, so it stays valid.
        """
        problem, values = self.problem, self.problem.values
        made_now = made[value] - made_before.get(value, 0)
        alive = self._alive(model, step, made_before, made, first, last, latest)
        for u in (value, *values[value].inputs):
            if not values[u].available:
                self._add_alive(alive, u, made_now)
        before = working_while_making(backward_steps_of(problem), step)
        own = values[value]
        transient = problem.storage_bytes[own.storage] if Tag.DROPOUT_REPLAY in own.tags else own.scratch_bytes
        self._emit(model, f"y{step}_{value}", alive, 0, self._units(before + transient) * made_now)

    def _forward_row(self, model: Model, at: int) -> None:
        """The forward right after ``at`` is computed: what every plan holds then.

        Every plan computes the ancestors of the step's outputs. A storage one of them starts is
        alive from that value to its last forward reader among them, and to the end when kept
        (a kept storage is paid, ``g_s``) or returned; ``at``'s kernel scratch comes on top.
        Values computed only because a plan keeps them are left out: fewer bytes, still valid.
        """
        problem, values = self.problem, self.problem.values
        always = _ancestors_of_outputs(problem)
        if at not in always:
            return
        start: dict[int, int] = {}
        end: dict[int, int] = {}
        for v in sorted(always):
            storage = values[v].storage
            start.setdefault(storage, v)
            end[storage] = max(end.get(storage, v), max((u for u in problem.users[v] if u in always), default=v))
        returned = {values[i].storage for i in problem.forward_outputs}
        held, terms = 0, []
        for storage, first_value in start.items():
            nbytes = problem.storage_bytes[storage]
            if not nbytes or first_value > at:
                continue
            if end[storage] >= at or storage in returned:
                held += nbytes
            elif storage in model.paid:
                terms.append(self._units(nbytes) * model.paid[storage])
        room = self.budget_bytes - self.margin - held - values[at].scratch_bytes
        lp = model.lp
        lp += pulp.lpSum(terms) <= self._room_units(room), f"f{at}_peak"

    def _alive(self, model: Model, step: int, made_then: dict[int, pulp.LpVariable],
               made_now: dict[int, pulp.LpVariable], first: dict[int, int], last: dict[int, int],
               latest: list[int]) -> dict[int, list]:
        """Per storage, the literals that make it alive at ``step``: ``made_then`` says which
        recomputed values are already held, ``made_now`` which readers of kept values are made."""
        alive: dict[int, list] = {}
        for v, read_last in last.items():
            if read_last < step:
                continue
            # Kept, or made already (every value recomputable and read by ``step`` is in
            # ``made_then``): a plan does at most one, so one literal k_v + m_v (as ``PeakRows``).
            literal = [term for term in (model.keep.get(v), made_then.get(v)) if term is not None]
            if literal:
                self._add_alive(alive, v, literal[0] if len(literal) == 1 else literal[0] + literal[1])
        # A value that is there (kept, or made already) lives until its recomputed readers are made.
        there = [*model.keep.items(), *made_then.items()]
        for u, present in there:
            for w in sorted(set(self.problem.users[u])):
                if w in model.recompute and latest[w] >= step:
                    self._add_alive(alive, u, present + model.recompute[w] - 1 - made_now.get(w, 0))
        return alive

    @functools.cached_property
    def _pinned(self) -> frozenset[int]:
        """The step outputs' storages: held to the end by the caller, counted in every row's room."""
        return frozenset(self.problem.values[i].storage for i in self.problem.forward_outputs)

    def _add_alive(self, alive: dict[int, list], value: int, literal: object) -> None:
        problem = self.problem
        storage = problem.values[value].storage
        if problem.storage_bytes[storage] and storage not in self._pinned:
            alive.setdefault(storage, []).append(literal)

    def _emit(self, model: Model, name: str, alive: dict[int, list], working: int, extra: object = 0) -> None:
        """sum of alive storages' bytes + ``extra`` <= budget - step outputs - ``working``."""
        problem, lp = self.problem, model.lp
        terms = [extra]
        for storage, literals in alive.items():
            size = self._units(problem.storage_bytes[storage])
            if len(literals) == 1 and isinstance(literals[0], pulp.LpVariable):
                terms.append(size * literals[0])
                continue
            either = fraction(lp, f"{name}_a{storage}")
            for index, literal in enumerate(literals):
                lp += either >= literal, f"{name}_a{storage}_{index}"
            terms.append(size * either)
        room = self.budget_bytes - self.margin - sum(problem.storage_bytes[s] for s in self._pinned) - working
        lp += pulp.lpSum(terms) <= self._room_units(room), f"{name}_peak"


@dataclass
class ExactRowPlaces:
    """Where exact rows have been placed so far (``solvers.peak.planner`` adds one where each plan of
    the relaxation peaks): backward steps' ops, (step, value) moments a recomputed value is
    made, and forward values."""

    problem: Problem
    steps: list[int] = field(default_factory=list)
    events: list[tuple[int, int]] = field(default_factory=list)
    forward_at: list[int] = field(default_factory=list)

    def add_where(self, plan: Plan, memory: PlanMemory, budget: int) -> bool:
        """A row where ``plan`` goes over ``budget``: at its peak, or, when a row is there
        already (rows at a value's making, or a second tensor, are not exact), at the highest
        other place over it that has none. False when every place over it has one."""
        events = backward_lifetimes(self.problem, plan)[0]
        computed = forward_computed(self.problem, plan.kept | plan.offloaded)
        over = [(live, "backward", i) for i, live in enumerate(memory.backward_live) if live > budget]
        over += [(live, "forward", i) for i, live in enumerate(memory.forward_live) if live > budget]
        for _, phase, index in sorted(over, key=lambda place: (-place[0], place[1], place[2])):
            if phase == "forward":
                if computed[index] not in self.forward_at:
                    self.forward_at.append(computed[index])
                    return True
                continue
            event = events[index]
            if event.value is None and event.step not in self.steps:
                self.steps.append(event.step)
                return True
            if event.value is not None and (event.step, event.value) not in self.events:
                self.events.append((event.step, event.value))
                return True
        return False

    def extension(self, budget: int, rounding: Rounding) -> ExactStepRows:
        return ExactStepRows(self.problem, budget, rounding, steps=tuple(self.steps), events=tuple(self.events),
                             forward_at=tuple(self.forward_at))


def _tuple_of(problem: Problem, value: int) -> int | None:
    """The multi-output op whose element ``value`` is (``getitem``), else None."""
    v = problem.values[value]
    return v.inputs[0] if v.op == "getitem" and len(v.inputs) == 1 else None


def _ancestors_of_outputs(problem: Problem) -> frozenset[int]:
    """Values every plan's forward computes: the outputs and what they are computed from."""
    found = {v for v in problem.forward_outputs if not problem.values[v].available}
    stack = list(found)
    while stack:
        for u in problem.values[stack.pop()].inputs:
            if u not in found and not problem.values[u].available:
                found.add(u)
                stack.append(u)
    return frozenset(found)


def exact_backend_for(name: str, backend: str) -> str:
    """The backend of the exact rows' MIPs: "auto" is CP-SAT where OR-Tools is installed (it
    proves their optimum in seconds where HiGHS's bound stalls: their LP relaxation is weak),
    else ``backend``, the one the other searches use."""
    if name != "auto":
        return resolve_backend(name)
    if backend_works("cpsat"):
        return "cpsat"
    logger.info("ilp_peak: OR-Tools is not installed; the exact rows run on %s, which closes their gap "
                "slowly (`pip install ortools` for CP-SAT)", backend)
    return backend
