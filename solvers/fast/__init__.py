"""The fast planner: Lagrangian min-cuts over (identical) blocks, then short exact refinements.

Without the budget row, keep/recompute is an s-t minimum cut (``solvers.mip.min_cut``). For a
multiplier ``lambda`` the cut is the best plan for ``seconds + lambda * bytes`` (``oracle``, which
cuts each distinct block once: ``blocks``); sweeping it traces the lower convex hull of the
memory/recompute trade-off (``hull``), and ``mincut(lambda) - lambda * B`` is a lower bound on
the optimum for budget ``B``. The planner (``planner``) brackets the budget on the hull, mixes
the per-block answers of the two points around it, and closes what it can of the remaining gap
with a warm-started ILP (``polish``) or bucket-by-bucket exact sub-problems (``refine``, with
``allocate`` splitting a bucket's bytes across its identical groups).
"""

from .hull import HullPoint, tradeoff_hull
from .planner import solve_fast

__all__ = ["HullPoint", "solve_fast", "tradeoff_hull"]
