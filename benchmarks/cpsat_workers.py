"""How the exact rows' first MIP solves: HiGHS against CP-SAT at several worker counts.

``ilp_peak``'s first exact round (``solvers.peak.exact_rows``): the valid rows' relaxation is solved,
an exact row goes where its plan overshoots (per-block checkpointing's simulated peak as the
budget, recompute priced by FLOPs, the models of ``benchmarks.peak_optimality``), and that MIP is
handed to each backend for ``--seconds``. Printed per run: the status, the incumbent and the
proven bound over per-block checkpointing's recompute time, and the wall time. The bound is what
matters: the round proves its optimum when it meets the incumbent. CP-SAT's worker count
(``solvers.mip.cpsat.WORKERS``) is set per run here; workers beyond the cores time-share them.

    python -m benchmarks.cpsat_workers --model llama --workers 2,4,8,12
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from remat_pass.solvers import baselines
from remat_pass.solvers.mip import cpsat
from remat_pass.solvers.mip.solve import run_mip
from remat_pass.solvers.mip.keep_model import build, rounding_for, time_weights
from remat_pass.solvers.mip.run_keep import solve_once
from remat_pass.solvers.peak.exact_rows import ExactRowPlaces
from remat_pass.solvers.analysis.memory import simulate_plan
from remat_pass.solvers.peak.rows import PeakRows
from remat_pass.solvers.problem import Plan

from .models import ModelSpec
from .peak_optimality import KINDS, traced_problem

logger = logging.getLogger("benchmarks.cpsat_workers")


def first_exact_round(kind: str) -> tuple[object, float, float]:
    """The first exact round's PuLP model, its objective unit (seconds) and per-block's cost."""
    problem = traced_problem(ModelSpec(kind, layers=4, hidden=64, heads=4, seq=128, batch=4, vocab=256))
    per_block = baselines.per_block(problem)
    reference = Plan(problem, per_block.kept, per_block.recomputed, "per_block")
    budget = simulate_plan(problem, reference).peak_bytes
    relaxed = rounding_for(problem).optimistic()
    weights, unit = time_weights(problem)
    outcome = solve_once(problem, None, rounding=relaxed, weights=weights, time_limit=60, backend="highs",
                         extension=PeakRows(problem, budget, relaxed))
    places = ExactRowPlaces(problem)
    if outcome.plan is None or not places.add_where(outcome.plan, simulate_plan(problem, outcome.plan), budget):
        raise SystemExit(f"{kind}: the relaxation's plan fits per-block's peak; no exact round to time")
    model = build(problem, relaxed, None, weights)
    places.extension(budget, relaxed).add(model)
    return model, unit, reference.recompute_seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=KINDS, default="llama")
    parser.add_argument("--workers", default="2,4,8,12", help="CP-SAT worker counts, comma-separated")
    parser.add_argument("--seconds", type=float, default=20.0, help="each run's time limit")
    parser.add_argument("--no-highs", action="store_true", help="skip the HiGHS run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    model, unit, scale = first_exact_round(args.model)
    logger.info("%s: first exact round, %d columns, %d rows", args.model, len(model.lp.variables()),
                model.lp.numConstraints())
    runs = [] if args.no_highs else [("highs", None)]
    runs += [("cpsat", int(n)) for n in args.workers.split(",")]
    default_workers = cpsat.WORKERS
    try:
        for backend, workers in runs:
            cpsat.WORKERS = workers or default_workers
            began = time.perf_counter()
            result = run_mip(model.lp, backend=backend, time_limit=args.seconds)
            seconds = time.perf_counter() - began
            cost = "-" if result.objective is None else f"{result.objective * unit / scale:.4f}"
            bound = "-" if result.bound is None else f"{result.bound * unit / scale:.4f}"
            logger.info("%-6s workers %-4s %-9s incumbent %s  bound %s  (x per-block)  %.1f s", backend,
                        workers or "-", result.status, cost, bound, seconds)
    finally:
        cpsat.WORKERS = default_workers
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
