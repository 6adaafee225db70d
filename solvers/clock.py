"""The clock a planner's time limit is counted on: the time this process worked on the plan.

The planners split their time limit into shares (searches, repairs, bounds) and read deadlines
against a clock. Counted on the wall clock, a busy machine gives a planner less work in the same
limit, so the same graph and budget can be planned in one run and refused in another: the Inductor
fit of a small HF GPT-2 at torch's 0.1 point was refused with three processes on two cores and
planned when rerun on a quieter machine (benchmarks/VS_INDUCTOR.md). A budget is a promise, and
whether it is kept should not depend on what else the machine runs.

So within a planning call (``counting``, which ``registry.planner`` opens around every planner) the
clock advances by the *smaller* of the wall time and the CPU time this process spent since the
call began (all its threads, and the solver children it has waited for: ``mip.backend_run``'s
isolated runs). On a quiet machine that is the wall clock (a multithreaded solver, whose CPU
time runs ahead of the wall's, does not shorten the limit); on a busy one, the work done, so the
limit buys the same searches and the call takes longer on the wall. Outside a call ``now`` is the
wall clock. What this does not make deterministic: a MIP backend's own time limit is on the wall
clock (HiGHS, CP-SAT), so a solve its limit cuts short can still end differently under load.

>>> with counting():
...     began = now()
...     time.sleep(0.05)  # no work: the planning clock stands still
...     now() - began < 0.04
True
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import time
from typing import Iterator

_STARTED: contextvars.ContextVar[tuple[float, float] | None] = contextvars.ContextVar("planning_started", default=None)


def _cpu_seconds() -> float:
    """CPU time of this process's threads and of the children it has waited for."""
    times = os.times()
    return time.process_time() + times.children_user + times.children_system


def now() -> float:
    """The planning clock, in the units of ``time.perf_counter`` (deadlines are ``now() + seconds``)."""
    started = _STARTED.get()
    wall = time.perf_counter()
    if started is None:
        return wall
    wall_began, cpu_began = started
    return wall_began + min(wall - wall_began, _cpu_seconds() - cpu_began)


@contextlib.contextmanager
def counting() -> Iterator[None]:
    """Count ``now`` from here as the time this process works (nested calls share the outer count)."""
    if _STARTED.get() is not None:
        yield
        return
    token = _STARTED.set((time.perf_counter(), _cpu_seconds()))
    try:
        yield
    finally:
        _STARTED.reset(token)


__all__ = ["counting", "now"]
