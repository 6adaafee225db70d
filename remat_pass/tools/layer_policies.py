"""The four per-layer activation policies and the search for how many layers take each.

Torch-free and shape-free: given each policy's per-layer stored bytes, transient rebuild bytes
and extra seconds (``PolicyRow``), find the cheapest count of layers per policy whose peak fits
a byte budget. ``remat_pass.tools.estimate`` derives the rows from a transformer's shape
(Korthikanti et al.'s formulas) and the hardware; this module only counts.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

logger = logging.getLogger(__name__)


class Policy(str, Enum):
    """What one layer does with its activations between forward and backward."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"
    OFFLOAD = "offload"


# Placement from the input layer upward; backward visits them in reverse.
_ORDER = (Policy.OFFLOAD, Policy.FULL, Policy.SELECTIVE, Policy.NONE)


@dataclass(frozen=True)
class PolicyRow:
    """One policy's per-layer figures and how many layers the plan gives it."""

    policy: Policy
    layers: int
    stored_bytes: int
    transient_bytes: int
    extra_seconds: float


def activation_peak(rows: Mapping[Policy, PolicyRow], counts: Mapping[Policy, int]) -> int:
    """Peak layer-activation bytes (stored plus transient) for a policy count assignment."""
    total = sum(counts.get(p, 0) * row.stored_bytes for p, row in rows.items())
    peak, below = total, 0
    for policy in _ORDER:
        n = counts.get(policy, 0)
        if n:
            below += n * rows[policy].stored_bytes
            peak = max(peak, below + rows[policy].transient_bytes)
    return peak


def _cost(rows: Mapping[Policy, PolicyRow], counts: Mapping[Policy, int]) -> float:
    return sum(n * rows[p].extra_seconds for p, n in counts.items() if n)


def _counts(n_off: int, n_full: int, n_sel: int, rest: int) -> dict[Policy, int]:
    return {Policy.OFFLOAD: n_off, Policy.FULL: n_full, Policy.SELECTIVE: n_sel, Policy.NONE: rest - n_sel}


def _fewest_selective(rows: Mapping[Policy, PolicyRow], n_off: int, n_full: int, rest: int,
                      budget: int) -> int:
    """Smallest selective count that fits; valid because the peak is non-increasing in it."""
    lo, hi = 0, rest
    while lo < hi:
        mid = (lo + hi) // 2
        if activation_peak(rows, _counts(n_off, n_full, mid, rest)) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return lo


def search_counts(rows: Mapping[Policy, PolicyRow], layers: int,
                  budget: int) -> tuple[dict[Policy, int] | None, int]:
    """Cheapest fitting counts (ties: fewest changed layers, then lowest peak) and the lowest peak.

    ``rows`` holds only the available policies; ``budget`` is what is left for layer
    activations. Returns ``(None, lowest_peak)`` when nothing fits.
    """
    best: tuple[tuple[float, int, int], dict[Policy, int]] | None = None
    lowest = math.inf
    has_sel = Policy.SELECTIVE in rows
    for n_off in range(layers + 1) if Policy.OFFLOAD in rows else (0,):
        for n_full in range(layers - n_off + 1):
            rest = layers - n_off - n_full
            floor = activation_peak(rows, _counts(n_off, n_full, rest if has_sel else 0, rest))
            lowest = min(lowest, floor)
            if floor > budget:
                continue
            n_sel = _fewest_selective(rows, n_off, n_full, rest, budget) if has_sel else 0
            counts = {p: n for p, n in _counts(n_off, n_full, n_sel, rest).items() if p in rows}
            key = (_cost(rows, counts), n_off + n_full + n_sel, activation_peak(rows, counts))
            if best is None or key < best[0]:
                best = (key, counts)
    logger.debug("searched %d layers: best %s, lowest peak %s", layers, best, lowest)
    return (None if best is None else best[1]), int(lowest)
