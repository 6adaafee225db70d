"""remat_pass's per-step cost against torch.compile's, before and after the step-overhead fixes (issue 35).

For each model and point (``vs_inductor``'s: ``default`` is torch.compile with Inductor and no
budget patched), three rows are built and timed in the same interleaved rounds
(``runner.interleaved``): the incumbent, remat_pass at the incumbent's measured peak with
``inner="inductor"`` as it is now (``after``), and the same with the three behaviours this
change replaced put back (``before``), so that drift on a shared machine hits all three alike:

* the per-call checkpoint flag set with ``torch._dynamo.config.patch`` (a class built per call);
* every call bound to forward's signature (``inspect.Signature.bind``);
* only partitioner-tagged nodes derived in backward, so the untagged ``eq`` Inductor's joint-graph
  pattern makes for cross-entropy's backward is kept from the forward (a planning change: the
  ``before`` row plans with it).

The third is a planning behaviour, the first two per-call ones; ``--before calls`` keeps only the
per-call ones (the plan the same as ``after``'s); ``--before fused`` puts back only what
``planning.fused_free`` changed (values Inductor recomputes for free kept, as eager's plan);
``--before prices`` plans with every recompute priced as a kernel of its own (the roofline of the
unfused program) instead of fused into its reader (``annotate.fused_costs``). Each row's peak over the budget and gradients
against the incumbent's are reported beside the times.

    python -m benchmarks.step_overhead --model gpt --model hf_gpt2 --points default,0.3 --rounds 15
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence
from unittest import mock

import torch
from torch import fx

import remat_pass

from benchmarks import cli, runner
from benchmarks.models import ModelSpec, build
from benchmarks.strategies import Prepared
from benchmarks.vs_inductor import INNERS, MODELS, PRESETS, Settings, incumbent, measure, point_list, remat_step

log = logging.getLogger(__name__)
BEFORE = ("all", "calls", "fused", "prices")
SIZES = ("layers", "hidden", "heads", "seq", "batch", "vocab")


def _patched_per_call() -> contextlib.AbstractContextManager[None]:
    """The flag as set before: ``config.patch``, a class built on every call."""
    import torch._dynamo.config as dynamo_config

    flag = "skip_fwd_side_effects_in_bwd_under_checkpoint"
    return dynamo_config.patch(**{flag: True}) if hasattr(dynamo_config, flag) else contextlib.nullcontext()


def _always_bound(signature: inspect.Signature | None, args: tuple[Any, ...], kwargs: Any) -> Any:
    """``canonical`` as before: every call bound to forward's signature."""
    if signature is None:
        return args, dict(kwargs)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return args, dict(kwargs)
    return bound.args, bound.kwargs


def _tagged_only(graph: fx.Graph, backward: set[fx.Node], num_fwd_outputs: int) -> set[fx.Node]:
    """``derived_in_backward`` as before: partitioner-tagged nodes only (the untagged ones it now
    adds are exactly those without a tag)."""
    from remat_pass.annotate import eager_parity

    derived = eager_parity.derived_in_backward(graph, backward, num_fwd_outputs)
    return {node for node in derived if "partitioner_tag" in node.meta}


def _before_calls() -> contextlib.AbstractContextManager[Any]:
    """The per-call behaviours as before: the flag set by ``config.patch``, every call bound."""
    from remat_pass.runtime import api

    return mock.patch.multiple(api, capture_config=_patched_per_call, canonical=_always_bound)


def _before(before: str) -> contextlib.AbstractContextManager[Any]:
    """The planning behaviour the ``before`` row puts back (the per-call ones: ``_before_calls``)."""
    from remat_pass.annotate import annotate
    from remat_pass.planning import pipeline

    if before == "all":  # only partitioner-tagged nodes derived in backward
        return mock.patch.object(annotate, "derived_in_backward", _tagged_only)
    if before == "fused":  # what Inductor would recompute for free kept (before planning.fused_free)
        return mock.patch.object(pipeline, "recompute_fused_free", lambda annotated, plan: plan)
    if before == "prices":  # every recompute priced as a kernel of its own (before annotate.fused_costs)
        return mock.patch.object(annotate, "fused_recompute_prices", lambda values, nodes, profile: tuple(values))
    return contextlib.nullcontext()


def run_point(spec: ModelSpec, point: str, settings: Settings, before: str, rounds: int,
              cpu_time: bool = True) -> list[dict[str, Any]]:
    runner.reset_between_rows()
    work = build(spec, device=settings.device, dtype=runner.RunConfig(dtype=settings.dtype).torch_dtype)
    torch_row = incumbent(point, work, settings.backend)
    row, reference = measure(torch_row, work, settings, {})
    budget = int(row["peak_act_bytes"])
    rows = {"torch": row}
    live: dict[str, Prepared] = {"torch": torch_row}
    refused: dict[str, int] = {}
    for name in ("after", "before"):
        planning = _before(before) if name == "before" else contextlib.nullcontext()
        try:
            with planning:
                prepared = remat_step(work, budget, "inductor", settings.remat_time_limit)
        except remat_pass.BudgetInfeasibleError as error:
            refused[name] = error.min_bytes  # a row of its own: the lowest peak found, no time
            continue
        if name == "before" and before in ("all", "calls"):
            prepared.context = _before_calls
        measured, _ = measure(prepared, work, settings, {"torch": reference})
        measured["peak_over_budget"] = measured["peak_act_bytes"] / budget
        rows[name], live[name] = measured, prepared
    clock = time.thread_time if cpu_time else time.perf_counter
    times = runner.interleaved(live, rounds, torch.device(settings.device), clock)
    out = [{"model": spec.label, "point": point, "row": name, "budget_bytes": budget, "refused_min_bytes": lowest}
           for name, lowest in refused.items()]
    for name, row in rows.items():
        ratios = [t / r for t, r in zip(times[name], times["torch"])]
        out.append({"model": spec.label, "point": point, "row": name, "budget_bytes": budget,
                    "step_ms": 1e3 * statistics.median(times[name]), "ratio": statistics.median(ratios),
                    "rounds_won": sum(r < 1 for r in ratios), "rounds": rounds,
                    "peak_over_budget": row.get("peak_over_budget"), "flops": row["flops"],
                    "grad_vs_torch": row.get("grad_vs_torch_scaled")})
    return out


def markdown(rows: Sequence[dict[str, Any]], command: str, wall: bool = False) -> str:
    lines = [f"Command: `{command}`", "", f"torch {torch.__version__}, CPU ({cli.cpu_name()}), fp32, "
             f"{torch.get_num_threads()} thread(s); step time by {'the wall clock' if wall else 'the thread CPU time'}, "
             "interleaved rounds after one untimed round; "
             "grad: max |Δg| / max |g| against the torch row.", "", "| model | point | row | step ms (median) | × torch (median) | rounds faster "
             "| peak / budget | MFLOP | grad vs torch |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "refused_min_bytes" in r:
            lines.append(f"| {r['model']} | {r['point']} | {r['row']} | refused: lowest peak found "
                         f"{r['refused_min_bytes'] / r['budget_bytes']:.3f} of the budget | | | | | |")
            continue
        over = f"{r['peak_over_budget']:.2f}" if r["peak_over_budget"] is not None else "–"
        grad = f"{r['grad_vs_torch']:.1e}" if isinstance(r["grad_vs_torch"], float) else "–"
        won = f"{r['rounds_won']}/{r['rounds']}" if r["row"] != "torch" else "–"
        ratio = f"{r['ratio']:.3f}" if r["row"] != "torch" else "1"
        lines.append(f"| {r['model']} | {r['point']} | {r['row']} | {r['step_ms']:.3f} | {ratio} | {won} | {over} "
                     f"| {r['flops'] / 1e6:.1f} | {grad} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", choices=MODELS)
    parser.add_argument("--points", type=point_list, default=["default"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--before", choices=BEFORE, default="all", help="what the before row puts back")
    parser.add_argument("--wall", action="store_true", help="time by the wall clock (default: the thread's CPU time)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/step_overhead"))
    for size in SIZES:
        parser.add_argument(f"--{size}", type=int, help=f"model {size} (default: the CPU preset's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    preset = PRESETS["cpu"]
    torch.set_num_threads(preset["threads"])
    settings = Settings(device="cpu", dtype="fp32", rounds=args.rounds, remat_time_limit=preset["remat_time_limit"],
                        inners=INNERS[:1])
    sizes = {k: getattr(args, k) or preset[k] for k in SIZES}
    rows: list[dict[str, Any]] = []
    command = "python -m benchmarks.step_overhead " + " ".join(argv if argv is not None else sys.argv[1:])
    for kind in args.model or ["gpt", "hf_gpt2"]:
        for point in args.points:
            rows += run_point(ModelSpec(kind, **sizes), point, settings, args.before, args.rounds, not args.wall)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "step_overhead.json").write_text(json.dumps(rows, indent=1, default=str))
            (args.out / "step_overhead.md").write_text(markdown(rows, command, args.wall))
            print(markdown(rows[-3:], command, args.wall), flush=True)
    print(markdown(rows, command, args.wall))
    return rows


if __name__ == "__main__":
    main()
