"""The peak planner (``"ilp_peak"``): the least recompute time whose simulated step peak fits the budget.

To change how it searches, open ``planner.py`` (its docstring lists the stages in order). Its
pieces: ``rows`` (the peak budget as ILP rows) and ``exact_rows`` (rows that follow the schedule
exactly), ``schedule_bound`` (a bound for any schedule), ``local_search``, ``mirrored_blocks``,
``fit_overshoot``, ``cap_repair_rows`` and ``multiple_recompute`` (refreshed values).
"""

from .planner import solve_peak

__all__ = ["solve_peak"]
