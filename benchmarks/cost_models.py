"""Cost models side by side: plans priced by the roofline, by FLOPs and by measured op times.

Run from the repository root::

    python -m benchmarks.cost_models                       # CPU: GPT- and Llama-style, budgets 0.3 and 0.1
    python -m benchmarks.cost_models --device cuda --dtype bf16 --quick
    python -m benchmarks.cost_models --help

For each model and budget (a fraction of the saved bytes), ``remat_pass.optimize`` plans the step
three times: ``costs="roofline"``, ``"flops"`` and ``"measure"`` (the last times each forward op
on this device first). Each plan's recomputed values are priced by every cost model (the graphs
are the same, value for value), so one row shows what the plan's own model predicted, what the
measured op times predict, its recomputed FLOPs, and what it really costs: the step-time
overhead over eager, measured with the variants interleaved (eager, roofline, flops, measure,
eager, ... for ``--rounds`` rounds), each round's overhead the difference against that round's
eager step (paired, so drift cancels), reported as median and interquartile range.

Where the measured plan recomputes more FLOPs than the FLOP plan, the last lines compare the two
round by round: in how many rounds the measured plan's step was faster, by how much (median),
and a one-sided sign test; "loses on FLOPs, wins on time" only where p < 0.05.

Results: ``--out`` (default ``benchmarks/out/cost_models``) ``cost_models.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import shlex
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

import remat_pass
from remat_pass.annotate.costs import CostModel

from .metrics import executed_flops
from .models import ModelSpec, Workload, build

logger = logging.getLogger(__name__)

DEFAULT_OUT = Path("benchmarks/out/cost_models")
COSTS = tuple(c.value for c in CostModel)  # roofline, flops, measure
KEEP_ALL = "keep-all"  # remat_pass at budget 1.0: its runtime, no recompute (the reference for recompute time)
MODELS = {
    "cpu": {
        "gpt": ModelSpec("gpt", layers=4, hidden=256, heads=4, seq=256, batch=4, vocab=512, dropout=0.1),
        "llama": ModelSpec("llama", layers=4, hidden=256, heads=4, seq=512, batch=2, vocab=512),
    },
    "cuda": {
        "gpt": ModelSpec("gpt", layers=6, hidden=768, heads=12, seq=1024, batch=8, vocab=50304, dropout=0.1),
        "llama": ModelSpec("llama", layers=4, hidden=2048, heads=16, seq=2048, batch=2, vocab=32000),
    },
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model: torch.nn.Module, call: Callable[..., torch.Tensor], work: Workload) -> Callable[[], None]:
    def step() -> None:
        for parameter in model.parameters():
            parameter.grad = None
        work.loss_fn(call(*work.inputs), work.target).backward()

    return step


def _timed(step: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    started = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - started


def _interleaved(steps: dict[str, Callable[[], None]], rounds: int, warmup: int,
                 device: torch.device) -> dict[str, list[float]]:
    """Seconds of each step per round, the steps taken in turn (A B C D A B C D ...)."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(_timed(step, device))
    return times


def _quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def _priced(plan: Any, prices: Sequence[float]) -> float:
    return sum(prices[i] for i in plan.recomputed)


def run_point(work: Workload, budget: float, rounds: int, warmup: int, time_limit: float) -> dict[str, Any]:
    """Plan ``work`` at ``budget`` with every cost model and measure the three plans against eager
    and against remat_pass keeping everything (the same runtime, no recompute)."""
    device = work.inputs[0].device
    torch._dynamo.reset()  # each point compiles four more wrappers of one forward: stay under the recompile limit
    optimized, setup = {}, {}
    for costs in (*COSTS, KEEP_ALL):
        started = time.perf_counter()
        optimized[costs] = remat_pass.optimize(work.model, budget=1.0 if costs == KEEP_ALL else budget,
                                               costs="roofline" if costs == KEEP_ALL else costs,
                                               time_limit=time_limit, example_inputs=work.inputs,
                                               plan_cache=None)  # time the planning, not the plan cache
        setup[costs] = time.perf_counter() - started
    plans = {costs: module.plan for costs, module in optimized.items()}
    names = [v.name for v in plans["roofline"].problem.values]
    if any([v.name for v in plan.problem.values] != names for plan in plans.values()):
        raise RuntimeError("the captures gave different graphs; cannot price one plan by another's costs")
    prices = {costs: [v.recompute_seconds for v in plans[costs].problem.values] for costs in COSTS}
    eager_step = _step(work.model, work.model, work)
    step_flops = executed_flops(eager_step).total
    steps = {"eager": eager_step, **{costs: _step(work.model, module, work) for costs, module in optimized.items()}}
    times = _interleaved(steps, rounds, warmup, device)
    rows = []
    for costs, plan in plans.items():
        over_eager = _quartiles([t - e for t, e in zip(times[costs], times["eager"])])
        over_keep_all = _quartiles([t - k for t, k in zip(times[costs], times[KEEP_ALL])])
        rows.append({
            "costs": costs, "recomputed_values": len(plan.recomputed), "kept_bytes": plan.kept_bytes,
            "recompute_flops": plan.recompute_flops, "flop_overhead": plan.recompute_flops / step_flops,
            "predicted_own_s": plan.recompute_seconds,
            **{f"predicted_{model}_s": _priced(plan, prices[model]) for model in COSTS if model != "flops"},
            "over_eager_s": over_eager, "over_keep_all_s": over_keep_all,
            "over_eager_fraction": over_eager[1] / statistics.median(times["eager"]),
            "setup_s": setup[costs], "step_s": times[costs],
        })
    return {"model": work.spec.label, "budget": budget, "step_flops": step_flops, "eager_step_s": times["eager"],
            "rows": rows, "flops_vs_measure": _head_to_head(times["flops"], times["measure"], plans)}


def _head_to_head(flops_times: list[float], measure_times: list[float], plans: dict[str, Any]) -> dict[str, Any]:
    """The measured plan against the FLOP plan, round by round."""
    differences = [m - f for m, f in zip(measure_times, flops_times)]
    return {
        "extra_flops": plans["measure"].recompute_flops - plans["flops"].recompute_flops,
        "time_difference_median_s": statistics.median(differences),
        "measure_faster_rounds": sum(d < 0 for d in differences), "rounds": len(differences),
        "same_plan": plans["measure"].recomputed == plans["flops"].recomputed,
    }


def markdown(points: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"Command: `{meta['command']}`", "",
        f"torch {meta['torch']}, {meta['device']} ({meta['device_name']}), {meta['dtype']}, {meta['threads']} "
        f"threads; {meta['rounds']} interleaved rounds after {meta['warmup']} warm-up. Times per step; "
        "measured columns: median [interquartile range] of paired per-round differences.", "",
        "| model | budget | costs | recomputed | recompute FLOPs (of step) | predicted: own model | "
        "roofline | measured ops | measured: over keep-all | over eager | setup |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for point in points:
        for row in point["rows"]:
            lines.append(
                f"| {point['model']} | {point['budget']} | {row['costs']} | {row['recomputed_values']} | "
                f"{row['recompute_flops'] / 1e9:.3f} G (+{row['flop_overhead']:.1%}) | "
                f"{_ms(row['predicted_own_s'])} | {_ms(row['predicted_roofline_s'])} | "
                f"{_ms(row['predicted_measure_s'])} | {_spread(row['over_keep_all_s'])} | "
                f"{_spread(row['over_eager_s'])} ({row['over_eager_fraction']:+.1%}) | {row['setup_s']:.1f} s |")
    lines += ["", "Measure against FLOPs, paired rounds (measured plan's step minus the FLOP plan's):", ""]
    for point in points:
        duel = point["flops_vs_measure"]
        if duel["same_plan"]:
            verdict = "the same plan"
        else:
            faster, rounds = duel["measure_faster_rounds"], duel["rounds"]
            p_value = sign_test(faster, rounds)
            verdict = (f"{duel['extra_flops'] / 1e9:+.3f} GFLOPs recomputed, step {_ms(duel['time_difference_median_s'])} "
                       f"(median), faster in {faster}/{rounds} rounds (sign test p = {p_value:.3f})")
            if duel["extra_flops"] > 0 and p_value < 0.05:
                verdict += ": loses on FLOPs, wins on time"
        lines.append(f"- {point['model']} at {point['budget']}: {verdict}")
    return "\n".join(lines) + "\n"


def sign_test(wins: int, rounds: int) -> float:
    """One-sided sign test: the chance of ``wins`` or more in ``rounds`` fair coin flips (so a
    "wins on time" claim needs more than a majority of noisy rounds)."""
    return sum(math.comb(rounds, k) for k in range(wins, rounds + 1)) / 2 ** rounds if rounds else 1.0


def _spread(quartiles: Sequence[float]) -> str:
    q1, median, q3 = quartiles
    return f"{_ms(median)} [{_ms(q1)}, {_ms(q3)}]"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cost_models", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt,llama", help="comma-separated: gpt, llama")
    parser.add_argument("--budgets", default="0.3,0.1", help="fractions of the saved bytes, comma-separated")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved timed rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (the first compiles)")
    parser.add_argument("--threads", type=int, help="torch threads (default: 1 on CPU, torch's own on CUDA)")
    parser.add_argument("--time-limit", type=float, default=30.0, help="seconds per plan")
    parser.add_argument("--quick", action="store_true",
                        help="the first budget only, 5 rounds, 1 warm-up, 10 s per plan (an H200 run in ~2 minutes)")
    for name in ("layers", "hidden", "heads", "seq", "batch", "vocab"):
        parser.add_argument(f"--{name}", type=int, help=f"override every model's {name}")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return parser


def _write(out: Path, points: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    (out / "cost_models.json").write_text(json.dumps({"meta": meta, "points": points}, indent=1))
    (out / "cost_models.md").write_text(markdown(points, meta))


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    rounds, warmup = (5, 1) if args.quick else (args.rounds, args.warmup)
    time_limit = min(args.time_limit, 10.0) if args.quick else args.time_limit
    budgets = budgets[:1] if args.quick else budgets
    torch.set_num_threads(args.threads or (1 if args.device == "cpu" else torch.get_num_threads()))
    overrides = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq", "batch", "vocab")
                 if getattr(args, k) is not None}
    meta = {
        "command": "python -m benchmarks.cost_models " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "torch": torch.__version__, "device": args.device, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "rounds": rounds, "warmup": warmup,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    points: list[dict[str, Any]] = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        spec = replace(MODELS[args.device][name], **overrides)
        work = build(spec, device=args.device, dtype=DTYPES[args.dtype])
        for budget in budgets:
            logger.info("%s at %s: planning with %s", spec.label, budget, ", ".join(COSTS))
            points.append(run_point(work, budget, rounds, warmup, time_limit))
            _write(args.out, points, meta)  # after every point: a run cut short keeps what it measured
    print(markdown(points, meta))
    return points


if __name__ == "__main__":
    main()
