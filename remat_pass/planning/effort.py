"""How long planning may take, and how hard it works for a proof: the default and what changes it.

A torch.compile user expects planning that costs a second or two, so the default is short and
does no proof work (``FAST_TIME_LIMIT``); an explicit ``time_limit`` or ``prove=True`` buys the
proof work (exact rows, the any-schedule bound) and a tighter gap. One thing a short limit must not
cost is a wrong refusal: a budget no plan fits within the limit is searched on, up to
``REFUSAL_TIME_LIMIT``, before the planner calls it infeasible (``effort_options``).
"""

from __future__ import annotations

import inspect
from typing import Any

from remat_pass import solvers

DEFAULT_TIME_LIMIT = solvers.DEFAULT_TIME_LIMIT
"""Seconds a planner may take with ``prove=True`` and no ``time_limit`` (the planners' own default)."""

FAST_TIME_LIMIT = 2.0
"""Seconds the default planning may take per graph: no proof work (``prove=False``), a good plan and
the gap its searches proved. Measured (``benchmarks/SCALING.md``, "Two seconds by default"): on a
12-layer Hugging Face GPT-2 under a peak budget it gives the 60 s plan itself (a 17.5% gap where the
60 s proof work reaches 3.6%), on the 48-layer scaling GPT the 60 s plan in five of six runs (else
per-block's own plan, as the old 5 s default gave); on six other problems the same plans as at 5 s.
Where the tied rows' plan fits, the peak planner ends early (``solvers.peak.planner.SETTLED_SHARE``):
the 12-layer GPT-2 is planned in 0.9 s ("The first call, planned in half the limit")."""

REFUSAL_TIME_LIMIT = 10.0
"""Seconds a planner without proof work searches before it refuses a budget no plan fits: a 6-layer
BERT at 0.85 of per-block checkpointing's peak has a plan that 2 s of search do not find (5 s do)."""


def planning_effort(time_limit: float | None, prove: bool | None) -> tuple[float, bool]:
    """The time limit and whether to do the proof work, from what a caller passed.

    Neither (the default): ``FAST_TIME_LIMIT`` seconds, no proof work. An explicit ``time_limit``
    means "spend up to this, proving": proof work on, unless ``prove=False`` says otherwise.
    ``prove=True`` alone gets ``DEFAULT_TIME_LIMIT``.

    >>> planning_effort(None, None), planning_effort(30, None), planning_effort(None, True)
    ((2.0, False), (30, True), (60.0, True))
    """
    if prove is not None and not isinstance(prove, bool):
        raise TypeError(f"prove must be True, False or None, got {prove!r}")
    if time_limit is None:
        return (DEFAULT_TIME_LIMIT, True) if prove else (FAST_TIME_LIMIT, False)
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not time_limit > 0:
        raise ValueError(f"time_limit must be a positive number of seconds or None, got {time_limit!r}")
    return time_limit, prove is not False


def effort_options(solver: str, time_limit: float, prove: bool, search_before_refusing: bool = True,
                   probe_minimum: bool = True) -> dict[str, Any]:
    """The options that carry the effort to a planner that searches for a budget: its time limit,
    and for one with proof work it can skip (``ilp_peak``) whether to do it and, without it, how
    long to search before refusing a budget (at least ``REFUSAL_TIME_LIMIT``, unless
    ``search_before_refusing`` is off: the Inductor fit, where a refusal moves the fit to another
    budget; a 2-layer HF GPT-2's fit at torch's 0.1 point took 56 s with the longer search, 42 s without, one run each).
    ``probe_minimum`` off: a refusal states the lowest peak the search tried, without the probe of
    the trade-off curve that makes the stated minimum one a plan was found for (the fit's re-asked
    candidates, whose refusals only move the fit's bracket).

    >>> effort_options("ilp_peak", 2.0, False)
    {'time_limit': 2.0, 'prove': False, 'refusal_time_limit': 10.0}
    >>> effort_options("ilp", 2.0, False)
    {'time_limit': 2.0}
    >>> effort_options("ilp_peak", 2.0, False, search_before_refusing=False)
    {'time_limit': 2.0, 'prove': False}
    """
    options: dict[str, Any] = {"time_limit": time_limit}
    if "prove" in inspect.signature(solvers.get_solver(solver)).parameters:
        options["prove"] = prove
        if not prove and search_before_refusing:
            options["refusal_time_limit"] = max(REFUSAL_TIME_LIMIT, time_limit)
        if not probe_minimum:
            options["probe_minimum"] = False
    return options
