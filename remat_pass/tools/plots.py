"""PNG plots of a sweep and of a memory timeline; needs the ``plot`` extra (matplotlib).

Figures are drawn on matplotlib's Agg canvas directly, without pyplot, so that plotting never
changes the backend or state of a session the user may be plotting in.

>>> from remat_pass import sweep
>>> from remat_pass.tools.plots import plot_pareto
>>> plot_pareto(sweep(model, (x,)), "pareto.png")  # doctest: +SKIP
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    from remat_pass.solvers.problem import Plan

    from .tradeoff import Sweep

_INSTALL_HINT = 'plotting needs matplotlib: pip install "remat-pass[plot]"'
_MARKERS = ("s", "v", "D", "^", "P", "X", "h", "<", ">", "d")


def _marker(solver: str) -> str:
    """One marker per registered planner, in registry order (``solvers.SOLVER_INFO``): a planner
    added to the registry gets its own marker without this module knowing its name."""
    from remat_pass import solvers

    names = list(solvers.SOLVER_INFO)
    return _MARKERS[names.index(solver) % len(_MARKERS)] if solver in names else "x"


def _figure(columns: int = 1) -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(_INSTALL_HINT) from error
    figure = Figure(figsize=(5.5 * columns, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, columns, squeeze=False)[0]
    return figure, axes


def _byte_unit(largest: float) -> tuple[str, float]:
    unit, scale = "B", 1.0
    for name in ("KiB", "MiB", "GiB", "TiB"):
        if largest < scale * 1024:
            break
        unit, scale = name, scale * 1024
    return unit, scale


def plot_pareto(sweep: Sweep, path: str | os.PathLike[str], *, highlight: Plan | None = None,
                title: str | None = None) -> Path:
    """Kept bytes against recompute time (left) and FLOP overhead (right); writes a PNG at ``path``.

    The sweep's feasible points form the curve; each baseline gets its own marker; the
    smallest feasible budget and keep-all are vertical lines; ``highlight`` (e.g. the plan
    being explained) is a star; the sweep's ``hull`` (``sweep(..., hull=True)``) is a dashed line.
    """
    figure, (time_axis, flop_axis) = _figure(columns=2)
    unit, scale = _byte_unit(max(sweep.keep_all_bytes, 1))
    curve = [p for p in sweep.points if p.feasible]
    step = sweep.step_flops

    def draw(axis: Any, y_of: Any, ylabel: str) -> None:
        axis.plot([p.kept_bytes / scale for p in curve], [y_of(p.recompute_seconds, p.recompute_flops) for p in curve],
                  "o-", color="tab:blue", label=f"{sweep.solver} sweep", zorder=3)
        if sweep.hull:
            axis.plot([p.kept_bytes / scale for p in sweep.hull],
                      [y_of(p.recompute_seconds, p.recompute_flops) for p in sweep.hull],
                      "--", color="tab:grey", label="lower hull (fast planner)", zorder=2)
        for point in sweep.baselines:
            axis.plot(point.kept_bytes / scale, y_of(point.recompute_seconds, point.recompute_flops),
                      _marker(point.solver), markersize=8, linestyle="none",
                      label=point.solver, alpha=0.8)
        if highlight is not None:
            axis.plot(highlight.kept_bytes / scale, y_of(highlight.recompute_seconds, highlight.recompute_flops),
                      "*", color="tab:red", markersize=15, linestyle="none", label="this plan", zorder=4)
        if sweep.min_feasible_bytes is not None:
            axis.axvline(sweep.min_feasible_bytes / scale, color="grey", linestyle="--", linewidth=1,
                         label="smallest feasible")
        axis.axvline(sweep.keep_all_bytes / scale, color="grey", linestyle=":", linewidth=1, label="keep-all")
        axis.set_xlabel(f"kept for backward ({unit})")
        axis.set_ylabel(ylabel)
        axis.grid(True, alpha=0.3)

    draw(time_axis, lambda seconds, flops: seconds * 1e3, "estimated recompute time (ms)")
    draw(flop_axis, lambda seconds, flops: 100.0 * flops / step if step else 0.0,
         "recomputed FLOPs (% of the step)")
    flop_axis.legend(fontsize="small", loc="best")
    figure.suptitle(title or f"Memory / recompute trade-off ({sweep.problem.device}, {sweep.problem.costs} costs)")
    return _save(figure, path)


def plot_memory_timeline(timeline: Mapping[str, Sequence[tuple[float, float]]], path: str | os.PathLike[str], *,
                         title: str | None = None) -> Path:
    """Memory over the step, one line per series; writes a PNG at ``path``.

    ``timeline`` maps a series name to ``(step, bytes)`` pairs, typically two series such as
    ``{"keep-all": [...], "plan": [...]}``, as ``remat_pass.tools.report.memory_timeline(plan)`` returns
    (what ``remat-pass explain --plot`` draws).
    """
    if not timeline:
        raise ValueError("nothing to plot: the timeline has no series")
    figure, (axis,) = _figure()
    largest = max((nbytes for series in timeline.values() for _, nbytes in series), default=1)
    unit, scale = _byte_unit(max(largest, 1))
    for name, series in timeline.items():
        axis.step([s for s, _ in series], [b / scale for _, b in series], where="post", label=name)
    axis.set_xlabel("step (op in execution order)")
    axis.set_ylabel(f"memory ({unit})")
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize="small")
    figure.suptitle(title or "Memory over the training step")
    return _save(figure, path)


def _save(figure: Any, path: str | os.PathLike[str]) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=110)
    return target
