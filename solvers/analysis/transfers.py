"""The host link model: when an offloaded value's transfers run, and what they cost.

An offloaded value is saved for backward in host memory instead of device memory. Its storage
is sent to the host in forward (device -> host) and fetched back in backward (host -> device).
What this module assumes, and every planner and simulator in ``solvers`` shares:

* Time is the roofline time of the ops (``Value.recompute_seconds`` in forward,
  ``BackwardStep.seconds`` in backward), run one after another on one compute stream.
* The link has one transfer stream per direction, ``Problem.host_bytes_per_second`` each
  way, and runs one transfer at a time per direction, in issue order (PyTorch's
  ``ao.offload`` / ``ao.reload`` use one transfer stream per device). Both directions never
  overlap in time here anyway: sends run in forward, fetches in backward. Transfers do not
  slow compute down (in reality they share HBM bandwidth; the derated link number absorbs it).
* Forward: a storage's send is issued right after the op that makes it and starts when the
  link is free. Its device bytes stay allocated until its wait, which is placed after the
  first forward op that ends after the send has finished (and after the storage's last
  forward reader); in-flight buffers therefore count. A send still running when the forward
  ends stalls the step: that is exposed time.
* Backward: fetches are issued in the order backward needs them, each as late as the link
  allows while still finishing before the first backward op (or recomputation) that reads the
  storage (as late as possible, because a fetched storage occupies device memory from its
  issue on), at the start of a backward step. A fetch that cannot finish in time stalls
  compute until it does; later compute shifts by the stall, so the exposed time is the
  largest lateness.
* Host memory holds every offloaded storage between its send and its fetch: the host peak is
  the sum of offloaded bytes (``Plan.host_bytes``).

A storage is offloaded whole, once, with all its views (a view is rebuilt from the fetched
base in backward). Storages the step returns, storages of mutated values and storages whose
own transfer could not hide even with the link to themselves (``offload_candidates``) are
never offloaded: a value backward reads at once costs its full transfer time.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .graph_facts import effectively_recomputable, relevant_values
from .lifetimes import backward_lifetimes, backward_steps_of, forward_computed, read_spans
from ..problem import ANALYSES, Plan, Problem
from ..tags import Tag


@dataclass(frozen=True)
class Candidate:
    """A storage that may be offloaded: its transfer time each way, when forward makes it (end
    of its creator op, seconds from the start of forward) and when backward first reads it
    (seconds from the start of backward). ``early_users``: recomputable values that read it and
    that some plan could need before that first read; a plan that offloads the storage does
    not recompute them (their recomputation would need the storage before its deadline)."""

    storage: int
    creator: int
    seconds: float
    release: float
    deadline: float
    early_users: tuple[int, ...] = ()


def forward_times(problem: Problem) -> tuple[list[float], float]:
    """End time of each value's op in forward (problem order), and the forward's total time."""
    ends, clock = [], 0.0
    for value in problem.values:
        if not value.available:
            clock += value.recompute_seconds
        ends.append(clock)
    return ends, clock


def backward_step_starts(problem: Problem) -> list[float]:
    """Start time of each backward step (its op's roofline time, recomputation not counted)."""
    starts, clock = [], 0.0
    for step in backward_steps_of(problem):
        starts.append(clock)
        clock += step.seconds
    return starts


def storage_creators(problem: Problem) -> dict[int, int]:
    """The first value of each storage with bytes: the op that allocates it."""
    creators: dict[int, int] = {}
    for value in problem.values:
        if problem.storage_bytes[value.storage] > 0:
            creators.setdefault(value.storage, value.id)
    return creators


def _earliest_need_steps(problem: Problem) -> dict[int, int]:
    """Per value, the earliest backward step that could read it, directly or through values
    recomputed from it (any plan): a conservative deadline for its fetch."""
    first_read, _ = read_spans(problem)
    recomputable = effectively_recomputable(problem)
    users = problem.users
    earliest: dict[int, int] = {}
    for value in reversed(problem.values):
        steps = [first_read[value.id]] if value.id in first_read else []
        steps += [earliest[u] for u in users[value.id] if recomputable[u] and u in earliest]
        if steps:
            earliest[value.id] = min(steps)
    return earliest


def offload_candidates(problem: Problem) -> dict[int, Candidate]:
    """Storages the planner may offload, by storage id (empty without a host link).

    Excluded: storages without bytes, those the step returns (they stay on the device anyway),
    those with a mutated value, those whose creator is a view or cannot be saved, and those
    whose transfer cannot hide even alone on the link: less forward compute after the creator
    than the send takes, or less backward compute before backward first reads it than the
    fetch takes (so a value backward reads at once is never offloaded).
    """
    bandwidth = problem.host_bytes_per_second
    if bandwidth <= 0:
        return {}
    values = problem.values
    ends, forward_total = forward_times(problem)
    step_starts = backward_step_starts(problem)
    need = _earliest_need_steps(problem)
    first_read, _ = read_spans(problem)
    recomputable = effectively_recomputable(problem)
    users = problem.users
    relevant = relevant_values(problem)
    returned = {values[i].storage for i in problem.forward_outputs}
    members: dict[int, list[int]] = {}
    for value in values:
        members.setdefault(value.storage, []).append(value.id)
    found: dict[int, Candidate] = {}
    for storage, creator in storage_creators(problem).items():
        ids = members[storage]
        head = values[creator]
        if storage in returned or head.available or not head.keepable or Tag.VIEW in head.tags:
            continue
        if any(Tag.MUTATION in values[i].tags for i in ids) or not any(i in relevant for i in ids):
            continue
        steps = [first_read[i] for i in ids if i in first_read]
        if not steps:
            continue
        seconds = problem.storage_bytes[storage] / bandwidth
        deadline = step_starts[min(steps)]
        early = sorted({u for i in ids for u in users[i] if values[u].storage != storage and recomputable[u]
                        and need.get(u, len(step_starts)) < min(steps)})
        if seconds <= forward_total - ends[creator] and seconds <= deadline:
            found[storage] = Candidate(storage, creator, seconds, ends[creator], deadline, tuple(early))
    return found


@dataclass(frozen=True)
class Transfer:
    """One offloaded storage's two transfers, as the emitted graphs run them.

    ``wait_after``: the forward value after whose op the send's wait runs (the device bytes
    are freed there). ``reload_step``: the backward step at whose start the fetch is issued
    (its device buffer is allocated there). ``need_event``: the backward event
    (``lifetimes.backward_lifetimes``) that first reads the storage; the fetch's wait runs just
    before it. Times in seconds from the start of forward / backward.
    """

    storage: int
    creator: int
    seconds: float
    send_start: float
    send_end: float
    wait_after: int
    reload_step: int
    need_event: int
    fetch_start: float
    fetch_end: float
    need_time: float


@dataclass(frozen=True)
class TransferSchedule:
    """Every transfer of a plan and the time the link adds to the step."""

    transfers: tuple[Transfer, ...]
    forward_exposed_seconds: float
    backward_exposed_seconds: float

    @property
    def exposed_seconds(self) -> float:
        return self.forward_exposed_seconds + self.backward_exposed_seconds

    def by_storage(self) -> dict[int, Transfer]:
        return {t.storage: t for t in self.transfers}


def transfer_schedule(problem: Problem, plan: Plan) -> TransferSchedule:
    """When each of ``plan``'s transfers runs (see the module doc for the model)."""
    values = problem.values
    storages = sorted({values[i].storage for i in plan.offloaded})
    if not storages:
        return TransferSchedule((), 0.0, 0.0)
    bandwidth = problem.host_bytes_per_second
    creators = storage_creators(problem)
    seconds = {s: problem.storage_bytes[s] / bandwidth for s in storages}
    sends, forward_exposed = _forward_sends(problem, plan, storages, creators, seconds)
    fetches, backward_exposed = _backward_fetches(problem, plan, storages, seconds)
    transfers = tuple(
        Transfer(s, creators[s], seconds[s], *sends[s], *fetches[s]) for s in storages
    )
    return TransferSchedule(transfers, forward_exposed, backward_exposed)


def _forward_sends(problem: Problem, plan: Plan, storages: list[int], creators: dict[int, int],
                   seconds: dict[int, float]) -> tuple[dict[int, tuple[float, float, int]], float]:
    """(start, end, wait_after) per storage in forward, and the forward's exposed time."""
    values = problem.values
    computed = forward_computed(problem, plan.kept | plan.offloaded)
    in_forward = set(computed)
    clock, end_of, ends = 0.0, {}, []
    for i in computed:
        clock += values[i].recompute_seconds
        end_of[i] = clock
        ends.append(clock)
    forward_total = clock
    last_reader: dict[int, int] = {}
    for i in computed:
        for source in set(values[i].inputs) | {i}:
            storage = values[source].storage
            if source in in_forward:
                last_reader[storage] = max(last_reader.get(storage, i), i)
    result: dict[int, tuple[float, float, int]] = {}
    link_free = 0.0
    for storage in sorted(storages, key=lambda s: (creators[s], s)):
        start = max(end_of.get(creators[storage], 0.0), link_free)
        end = link_free = start + seconds[storage]
        floor = bisect.bisect_left(computed, last_reader.get(storage, creators[storage]))
        position = max(floor, bisect.bisect_left(ends, end))
        wait = computed[min(position, len(computed) - 1)]
        result[storage] = (start, end, wait)
    return result, max(link_free - forward_total, 0.0)


def _backward_fetches(problem: Problem, plan: Plan, storages: list[int],
                      seconds: dict[int, float]) -> tuple[dict[int, tuple[int, int, float, float, float]], float]:
    """(reload_step, need_event, start, end, need_time) per storage, and backward's exposed time."""
    values = problem.values
    steps = backward_steps_of(problem)
    events, _ = backward_lifetimes(problem, plan)
    offloaded = set(storages)
    need: dict[int, tuple[int, float]] = {}
    step_start: dict[int, float] = {}
    clock = 0.0
    for index, event in enumerate(events):
        step_start.setdefault(event.step, clock)
        if event.value is None:
            reads = steps[event.step].reads
            clock_after = clock + steps[event.step].seconds
        else:
            reads = values[event.value].inputs
            clock_after = clock + values[event.value].recompute_seconds
        for v in reads:
            storage = values[v].storage
            if storage in offloaded and storage not in need:
                need[storage] = (index, clock)
        clock = clock_after
    order = sorted(storages, key=lambda s: (need[s][0], s))
    latest: dict[int, float] = {}
    next_start = float("inf")
    for storage in reversed(order):  # as late as possible, one at a time
        latest[storage] = min(need[storage][1], next_start) - seconds[storage]
        next_start = latest[storage]
    step_times = sorted(step_start.items())
    result: dict[int, tuple[int, int, float, float, float]] = {}
    link_free, exposed = 0.0, 0.0
    for storage in order:
        need_event, need_time = need[storage]
        need_step = events[need_event].step
        issue_step = max((k for k, t in step_times if t <= latest[storage] and k <= need_step), default=0)
        start = max(step_start[issue_step], link_free)
        end = link_free = start + seconds[storage]
        exposed = max(exposed, end - need_time)
        result[storage] = (issue_step, need_event, start, end, need_time)
    return result, exposed


ANALYSES["transfer_schedule"] = transfer_schedule  # Plan.exposed_transfer_seconds reads it
