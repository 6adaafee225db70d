"""Peak memory of a plan, simulated on the torch-free Problem (no graphs needed).

This mirrors what the rewritten graphs do at run time (``remat_pass.rewrite.simulate`` replays the
graphs themselves; the tests check the two agree):

* forward: a value's storage is allocated when it is computed and freed after its last
  forward reader, unless it is kept for backward or returned, then it lives on;
* backward: the steps run in order; a recomputed value is materialized just before the first
  step that needs it (directly or through another recomputed value) and freed after its last
  use; a kept storage is freed after its last use, except the step's outputs, which the
  caller holds to the end whether kept or not; backward-only tensors (activation gradients)
  are the plan-independent ``BackwardStep.working_bytes``.

An offloaded storage (``solvers.analysis.transfers``) is on the device from its creation until the
forward wait of its send (in-flight sends count), and again from the backward step that issues
its fetch until its last use; in between it is in host memory, which is not counted here.

A recomputed value is materialized once and then held: recomputing a long chain for an early
backward step keeps the whole chain alive until its values' own last uses. That is why a plan
that keeps fewer bytes can peak higher, and why the peak-aware planner checks plans here. A
*refreshed* recomputed value (``Plan.refreshed``, multiple recomputation) is not held: it is
made again in each backward step that needs it and freed at that step's end, for its
recompute time once per such step (``lifetimes.materializations``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..problem import BackwardStep, Plan, Problem
from ..tags import Tag
from .lifetimes import backward_lifetimes, backward_steps_of, forward_computed
from .transfers import transfer_schedule


@dataclass(frozen=True)
class PlanMemory:
    """Simulated activation memory of a plan: the peak, where it is, and the timeline."""

    peak_bytes: int
    peak_phase: str
    peak_index: int
    forward_live: tuple[int, ...]
    backward_live: tuple[int, ...]
    backward_event_steps: tuple[int, ...] = ()  # the backward step of each ``backward_live`` entry

    def step_peak(self, step: int) -> int:
        """The most live bytes while backward step ``step`` runs (its materializations included)."""
        return max((live for live, at in zip(self.backward_live, self.backward_event_steps) if at == step), default=0)

    @property
    def forward_peak(self) -> int:
        return max(self.forward_live, default=0)

    @property
    def backward_peak(self) -> int:
        return max(self.backward_live, default=0)


def working_while_making(steps: tuple[BackwardStep, ...], step: int) -> int:
    """Backward-only bytes alive while step ``step``'s recomputations run, before its op: the
    previous step's working set less its kernel scratch (freed when that kernel ended)."""
    return steps[step - 1].working_bytes - steps[step - 1].scratch_bytes if step > 0 else 0


def _transient_bytes(problem: Problem, plan: Plan, value: int) -> int:
    """Extra bytes live for a moment while ``value`` is made: its kernel's scratch
    (``Value.scratch_bytes``, from annotate); a replayed dropout output is
    ``(input * mask) * scale``, two tensors of its size until the first is dropped."""
    v = problem.values[value]
    if value in plan.recomputed and Tag.DROPOUT_REPLAY in v.tags:
        return problem.storage_bytes[v.storage]
    return v.scratch_bytes


def _offload_lifetimes(problem: Problem, plan: Plan) -> tuple[dict[int, int], dict[int, int]]:
    """Per offloaded storage: the forward value after which its send's wait frees the device
    bytes, and the backward step that issues its fetch (device bytes allocated from then)."""
    if not plan.offloaded:
        return {}, {}
    transfers = transfer_schedule(problem, plan).transfers
    return {t.storage: t.wait_after for t in transfers}, {t.storage: t.reload_step for t in transfers}


def _forward_live(problem: Problem, plan: Plan) -> tuple[tuple[int, ...], set[int]]:
    """Live bytes after each forward value is computed; and the storages alive at the end."""
    computed = forward_computed(problem, plan.kept | plan.offloaded)
    in_forward = set(computed)
    values = problem.values
    survivors = {values[i].storage for i in plan.kept | (problem.forward_outputs & in_forward)}
    sent_after, _ = _offload_lifetimes(problem, plan)
    start: dict[int, int] = {}
    end: dict[int, int] = {}
    users = problem.users
    for i in computed:
        storage = values[i].storage
        if problem.storage_bytes[storage] == 0:
            continue
        last = max((u for u in users[i] if u in in_forward), default=i)
        last = max(last, sent_after.get(storage, last))
        start[storage] = min(start.get(storage, i), i)
        end[storage] = max(end.get(storage, last), last)
    allocated_at: dict[int, int] = {}
    freed_after: dict[int, int] = {}
    for storage, first in start.items():
        nbytes = problem.storage_bytes[storage]
        allocated_at[first] = allocated_at.get(first, 0) + nbytes
        if storage not in survivors:
            freed_after[end[storage]] = freed_after.get(end[storage], 0) + nbytes
    live, timeline = 0, []
    for i in computed:
        live += allocated_at.get(i, 0)
        timeline.append(live + _transient_bytes(problem, plan, i))
        live -= freed_after.get(i, 0)
    return tuple(timeline), {s for s in survivors if problem.storage_bytes[s] > 0}


def simulate_plan(problem: Problem, plan: Plan) -> PlanMemory:
    """Simulate the step's activation memory under ``plan`` (bytes, storages counted once)."""
    forward_live, survivors = _forward_live(problem, plan)
    events, lifetimes = backward_lifetimes(problem, plan)
    values = problem.values
    # The step's outputs live until it ends (the caller holds them), kept for backward or not:
    # freeing a kept output after its last backward use would let keeping it lower the peak.
    pinned = {values[i].storage for i in problem.forward_outputs} & survivors
    _, fetched_at = _offload_lifetimes(problem, plan)
    first_event = {}
    for index, event in enumerate(events):
        first_event.setdefault(event.step, index)
    copies = second_tensors(problem, plan, pinned)
    intervals: dict[int | tuple[str, int, int], tuple[int, int]] = {}
    for lifetime in lifetimes:
        v = lifetime.value
        storage: int | tuple[str, int, int] = values[v].storage
        if problem.storage_bytes[values[v].storage] == 0:
            continue
        if lifetime.copy:  # views of one refreshed storage made in one step are one tensor
            storage = ("fresh", values[v].storage, events[lifetime.begin].step)
        elif v in copies:
            storage = ("copy", values[v].storage, 0)
        elif storage in pinned:
            continue  # counted to the end
        begin = lifetime.begin
        if begin < 0 and storage in fetched_at:
            begin = first_event[fetched_at[storage]]
        old = intervals.get(storage)
        intervals[storage] = (begin, lifetime.end) if old is None else (min(old[0], begin), max(old[1], lifetime.end))
    delta = [0] * (len(events) + 2)
    for storage, (begin, last) in intervals.items():
        nbytes = problem.storage_bytes[storage[1] if isinstance(storage, tuple) else storage]
        delta[begin + 1] += nbytes
        delta[last + 2] -= nbytes
    pinned_bytes = sum(problem.storage_bytes[s] for s in pinned)
    steps = backward_steps_of(problem)
    backward_live, live = [], delta[0]
    for index, event in enumerate(events):
        live += delta[index + 1]
        if event.value is None:
            working = steps[event.step].working_bytes
        else:
            working = working_while_making(steps, event.step) + _transient_bytes(problem, plan, event.value)
        backward_live.append(live + working + pinned_bytes)
    forward_peak = max(forward_live, default=0)
    backward_peak = max(backward_live, default=0)
    if backward_peak >= forward_peak and backward_live:
        phase, index, peak = "backward", backward_live.index(backward_peak), backward_peak
    else:
        phase, index, peak = "forward", forward_live.index(forward_peak) if forward_live else 0, forward_peak
    return PlanMemory(peak, phase, index, tuple(forward_live), tuple(backward_live),
                      tuple(event.step for event in events))


def storages_alive_at_peak(problem: Problem, plan: Plan, memory: PlanMemory) -> set[int]:
    """The storages (of some bytes) ``plan`` has alive at its simulated backward peak; empty when
    the peak is in the forward."""
    if memory.peak_phase != "backward":
        return set()
    at, values = memory.peak_index, problem.values
    return {values[lifetime.value].storage for lifetime in backward_lifetimes(problem, plan)[1]
            if lifetime.begin <= at <= lifetime.end and problem.storage_bytes[values[lifetime.value].storage] > 0}


def peak_step_alive(problem: Problem, plan: Plan, memory: PlanMemory) -> tuple[int | None, set[int], int]:
    """The backward step of ``plan``'s peak, its storages alive then (``storages_alive_at_peak``) and
    the step's working bytes; (None, empty, 0) when the peak is in the forward."""
    if memory.peak_phase != "backward":
        return None, set(), 0
    step = memory.backward_event_steps[memory.peak_index]
    return step, storages_alive_at_peak(problem, plan, memory), backward_steps_of(problem)[step].working_bytes


def second_tensors(problem: Problem, plan: Plan, pinned: set[int]) -> set[int]:
    """Recomputed values that make a second tensor of a storage backward also has: a step
    output (held to the end), or a storage kept or offloaded through another value (the kept
    view of a softmax while the softmax itself is recomputed to rebuild a dropout). A view
    recomputed from the held tensor is not one; a view of a second tensor is."""
    values = problem.values
    had = {values[i].storage for i in plan.kept | plan.offloaded} | pinned
    found: set[int] = set()
    for v in sorted(plan.recomputed):
        value = values[v]
        if value.storage not in had:
            continue
        same = [u for u in value.inputs if values[u].storage == value.storage]
        if Tag.VIEW not in value.tags or not same or any(u in found for u in same):
            found.add(v)
    return found


