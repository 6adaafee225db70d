"""How planning time grows with depth, and a Llama-2-70B-shaped step planned on this machine.

Run from the repository root::

    python -m benchmarks.scaling --layers 12,24,48,96 --budgets 0.1,0.3,0.5 --ilp-time-limit 600
    python -m benchmarks.scaling --llama70b
    python -m benchmarks.scaling --llama405b
    python -m benchmarks.scaling --peak --layers 12,24,48
    python -m benchmarks.scaling --peak --layers 12,24,48 --peak-time-limit 0
    python -m benchmarks.scaling --peak --layers 48 --peak-time-limit 0 --via-plan
    python -m benchmarks.scaling --first-call
    python -m benchmarks.scaling --one-call /tmp/plans    # twice: a cached re-plan in a new process
    python -m benchmarks.scaling --plan-calls /tmp/plans  # plan() twice; again: in a new process
    python -m benchmarks.scaling --help

Depth sweep: GPT-style decoders (``remat_pass.examples.GPT``: hidden 768, 12 heads, sequence 1024,
dropout 0.1, batch 1, LM loss) built on the meta device and traced as fake tensors (nothing is
allocated), then planned with the "fast" solver and with the exact "ilp" under a time limit.
Capture, annotate and each solve are timed separately. ``--llama70b``: a Hugging Face
``LlamaForCausalLM`` with Llama-2-70B's shapes (80 layers, hidden 8192, 64 heads, 8 KV heads,
intermediate 28672, vocab 32000, sequence 4096, batch 1, bf16) on the meta device, planned whole;
wall time and peak RSS, the per-layer decisions, what the un-rematerialized step keeps per layer
next to Korthikanti et al. 2022's formula, and the memory/recompute trade-off curve. ``--peak``:
the same GPTs under a *peak* budget, per-block checkpointing's simulated peak, planned by the peak
planner (``ilp_peak``) in its default time limit: planning time, recompute against per-block's,
status and gap, as depth grows.

Results go to ``--out`` (default ``benchmarks/out/scaling``): ``scaling.json`` and ``scaling.md``,
``llama70b.json`` and ``llama70b.md``, ``peak.json`` and ``peak.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from remat_pass import solvers
from remat_pass.planning.effort import planning_effort
from remat_pass.tools.tradeoff import hull_points
from remat_pass.solvers.problem import Plan, Problem, format_bytes

DEFAULT_OUT = Path("benchmarks/out/scaling")


class _LMStep(nn.Module):
    """Model plus next-token loss: the traced step includes the loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())


def trace_timed(step: nn.Module, inputs: tuple[Any, ...], device: str) -> tuple[Problem, float, float, int]:
    """Capture and annotate on fake tensors; (problem, capture seconds, annotate seconds, graph pieces)."""
    from remat_pass.annotate.annotate import annotate
    from remat_pass.capture.capture import capture
    from remat_pass.planning.pipeline import merge_problems
    from remat_pass.planning.plan_model import traceable

    torch._dynamo.reset()
    began = time.perf_counter()
    with traceable(step, inputs) as fake_inputs:
        graphs = capture(step, fake_inputs)
    captured = time.perf_counter()
    problem = merge_problems([annotate(joint, device).problem for joint in graphs])
    annotated = time.perf_counter()
    torch._dynamo.reset()
    return problem, captured - began, annotated - captured, len(graphs)


def gpt_problem(args: argparse.Namespace, layers: int) -> tuple[Problem, float, float, int]:
    from remat_pass.examples import GPT, GPTConfig

    config = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, layers=layers, hidden=args.hidden, heads=args.heads,
                       dropout=args.dropout)
    with torch.device("meta"):
        model = GPT(config)
    tokens = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    return trace_timed(_LMStep(model), (tokens,), args.device)


def _solve(problem: Problem, budget: int, solver: str, **options: Any) -> dict[str, Any]:
    began = time.perf_counter()
    try:
        plan = solvers.solve(problem, budget, solver=solver, **options)
    except solvers.BudgetInfeasibleError as error:
        return {"status": "infeasible", "seconds": time.perf_counter() - began, "min_bytes": error.min_bytes}
    except solvers.SolverError as error:
        return {"status": "no plan", "seconds": time.perf_counter() - began, "error": str(error)[:200]}
    return {"status": plan.status, "gap": plan.gap, "seconds": time.perf_counter() - began,
            "recompute_seconds": plan.recompute_seconds, "recompute_flops": plan.recompute_flops,
            "kept_bytes": plan.kept_bytes}


def run_scaling(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for layers in args.layers:
        problem, capture_s, annotate_s, pieces = gpt_problem(args, layers)
        keep_all = problem.keep_all_bytes()
        print(f"L={layers}: {len(problem.values)} values, keep-all {format_bytes(keep_all)}, capture {capture_s:.1f}s, "
              f"annotate {annotate_s:.2f}s", flush=True)
        for fraction in args.budgets:
            budget = int(fraction * keep_all)
            fast = _solve(problem, budget, "fast", time_limit=args.fast_time_limit)
            exact = _solve(problem, budget, "ilp", time_limit=args.ilp_time_limit) if args.ilp_time_limit > 0 else {}
            row = {"layers": layers, "values": len(problem.values), "pieces": pieces, "keep_all_bytes": keep_all,
                   "budget_fraction": fraction, "budget_bytes": budget, "capture_s": capture_s,
                   "annotate_s": annotate_s, "fast": fast, "ilp": exact}
            if args.ablate_blocks:  # the bare hull + block mixing, with and without shared blocks
                bare = {"polish": False, "refine": False, "time_limit": args.fast_time_limit}
                row["hull_only"] = _solve(problem, budget, "fast", **bare)
                row["hull_only_no_blocks"] = _solve(problem, budget, "fast", blocks=False, **bare)
            if exact.get("status") == "optimal" and "recompute_seconds" in fast:
                optimum = exact["recompute_seconds"]
                versus = (fast["recompute_seconds"] - optimum) / optimum if optimum > 0 else 0.0
                row["fast_vs_ilp"] = 0.0 if abs(versus) < 1e-9 else versus
            rows.append(row)
            print(f"  budget {fraction:g}: fast {fast['seconds']:.2f}s {fast['status']} gap {fast.get('gap')}; "
                  f"ilp {exact.get('seconds', float('nan')):.2f}s {exact.get('status')}; "
                  f"fast vs ilp {row.get('fast_vs_ilp')}", flush=True)
    return rows


def run_peak(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The peak planner at per-block checkpointing's simulated peak, per depth."""
    rows = []
    for layers in args.layers:
        problem, capture_s, annotate_s, _ = gpt_problem(args, layers)
        per_block = solvers.solve(problem, None, solver="per_block")
        budget = solvers.simulate_plan(problem, per_block).peak_bytes
        began = time.perf_counter()
        # --peak-time-limit 0: what optimize(...) runs by default (effort.planning_effort)
        limit, prove = planning_effort(args.peak_time_limit or None, None)
        plan = solvers.solve(problem, budget, solver="ilp_peak", time_limit=limit, prove=prove)
        row = {"layers": layers, "values": len(problem.values), "backward_steps": len(problem.backward_steps),
               "budget_bytes": budget, "capture_s": capture_s, "annotate_s": annotate_s,
               "plan_s": time.perf_counter() - began, "time_limit": limit, "prove": prove, "status": plan.status,
               "gap": plan.gap, "source": plan.solver, "predicted_peak_bytes": plan.predicted_peak_bytes,
               "refreshed": len(plan.refreshed), "recompute_over_per_block": _ratio(plan.recompute_seconds,
                                                                                   per_block.recompute_seconds),
               "flops_over_per_block": _ratio(plan.recompute_flops, per_block.recompute_flops)}
        rows.append(row)
        print(f"L={layers}: {row['recompute_over_per_block']:.3f} x per_block ({plan.status}, gap {plan.gap}) "
              f"in {row['plan_s']:.1f}s, peak {plan.predicted_peak_bytes} <= {budget}", flush=True)
        if args.via_plan:
            row["via_plan"] = _peak_via_plan(args, layers, budget, per_block.recompute_seconds)
    return rows


def _peak_via_plan(args: argparse.Namespace, layers: int, budget: int, per_block_seconds: float) -> list[dict[str, Any]]:
    """``remat_pass.plan`` end to end on the same GPT and peak budget (the stack traced 3 and 4
    blocks deep and stamped, ``planning.repeated_blocks``), with the loss kept whole and with the
    default chunking rule, each then called again (answered before tracing, ``planning.trace_key``)."""
    import tempfile

    import remat_pass
    from remat_pass.examples import GPT, GPTConfig
    from remat_pass.planning.pipeline import with_headroom

    config = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, layers=layers, hidden=args.hidden, heads=args.heads,
                       dropout=args.dropout)
    with torch.device("meta"):
        step = _LMStep(GPT(config))
    tokens = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    rows = []
    for chunk_loss in (False, None):
        directory = tempfile.mkdtemp(prefix="remat_plans_")
        for call in ("first", "again"):
            torch._dynamo.reset()
            began = time.perf_counter()
            plan = remat_pass.plan(step, (tokens,), budget=with_headroom(budget), budget_kind="peak", solver="ilp_peak",
                                   device=args.device, chunk_loss=chunk_loss, plan_cache=directory,
                                   **({} if not args.peak_time_limit else {"time_limit": args.peak_time_limit}))
            row = {"chunk_loss": chunk_loss, "call": call, "wall_s": time.perf_counter() - began,
                   "solve_s": plan.solve_seconds, "status": plan.status, "gap": plan.gap,
                   "recompute_over_per_block": _ratio(plan.recompute_seconds, per_block_seconds),
                   "predicted_peak_bytes": plan.predicted_peak_bytes}
            rows.append(row)
            print(f"  plan(chunk_loss={chunk_loss}) {call}: {row['wall_s']:.1f}s (solve {plan.solve_seconds:.1f}s), "
                  f"{row['recompute_over_per_block']:.3f} x per_block, {plan.status}, gap {plan.gap}", flush=True)
    return rows


def first_call_model() -> tuple[nn.Module, torch.Tensor, int]:
    """The first-call model (12-layer HF GPT-2, h768, s512, loss inside), its tokens, and Hugging
    Face checkpointing's measured peak as the budget."""
    from .models import LossOf, hf_model
    from .vs_checkpoint import measured_step

    torch.manual_seed(0)
    vocab, seq, layers, hidden = 1024, 512, 12, 768
    tokens = torch.randint(0, vocab, (1, seq))
    model = LossOf(hf_model("gpt2", layers, hidden, seq, vocab), torch.randint(0, vocab, (1, seq))).train()
    model.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    budget = measured_step(model, model, tokens)["peak_bytes"]
    model.model.activation_checkpointing_disable()
    return model, tokens, budget


def run_first_call(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The first call of ``optimize`` on a 12-layer Hugging Face GPT-2 (h768, s512, batch 1, eager
    attention, no dropout, loss inside the step) under a peak budget, Hugging Face checkpointing's
    measured peak, as ``benchmarks.vs_checkpoint`` sets it: end to end (capture, annotate, plan,
    rewrite and the step ``example_inputs`` runs), by default and with each ``--first-call-limits``,
    then by default again from the plan cache the first run wrote (a fresh ``PlanCache`` object)."""
    import tempfile

    import remat_pass
    from remat_pass.runtime.plan_cache import PlanCache

    model, tokens, budget = first_call_model()
    rows = []
    directory = tempfile.mkdtemp(prefix="remat_plans_")  # a cache of its own: the first call is a miss
    for limit, cached in ((None, False), *((limit, False) for limit in args.first_call_limits), (None, True)):
        torch._dynamo.reset()
        cache = PlanCache(directory)  # fresh in memory: as a second process would read it
        began = time.perf_counter()
        plan = remat_pass.optimize(model, budget, budget_kind="peak", example_inputs=(tokens,), plan_cache=cache,
                                   **({} if limit is None else {"time_limit": limit})).plan
        rows.append({"time_limit": limit, "cache_hits": cache.hits, "first_call_s": time.perf_counter() - began,
                     "plan_s": plan.solve_seconds,
                     "status": plan.status, "gap": plan.gap, "recompute_seconds": plan.recompute_seconds,
                     "recompute_flops": plan.recompute_flops, "budget_bytes": budget,
                     "predicted_peak_bytes": plan.predicted_peak_bytes, "solver": plan.solver})
        print(f"time_limit={limit}{' (cached)' if cached else ''}: first call {rows[-1]['first_call_s']:.1f}s (plan {plan.solve_seconds:.1f}s), "
              f"recompute {plan.recompute_seconds:.6g}s, {plan.status}, gap {plan.gap}", flush=True)
    for row in rows:
        row["recompute_over_default"] = _ratio(row["recompute_seconds"], rows[0]["recompute_seconds"])
    return rows


def run_one_call(args: argparse.Namespace) -> dict[str, Any]:
    """One first call of ``optimize`` on ``--first-call``'s model and budget in this (fresh) process,
    against the plan cache in ``--one-call``'s directory: run it twice for a cached re-plan in a new
    process; delete the directory's ``scratch`` folder between to see what the stored kernel scratch saves."""
    import remat_pass
    from remat_pass.runtime.plan_cache import PlanCache

    model, tokens, budget = first_call_model()
    cache = PlanCache(args.one_call)
    spent = _timed_phases() if args.phases else {}
    began = time.perf_counter()
    plan = remat_pass.optimize(model, budget, budget_kind="peak", example_inputs=(tokens,), plan_cache=cache).plan
    row = {"cache_hits": cache.hits, "first_call_s": time.perf_counter() - began, "status": plan.status,
           "gap": plan.gap, "recompute_seconds": plan.recompute_seconds, "budget_bytes": budget, "phases_s": spent}
    print(f"one call: {row['first_call_s']:.1f}s, {cache.hits} hit(s), recompute {plan.recompute_seconds:.6g}s, "
          f"{plan.status}, gap {plan.gap}" + "".join(f", {k} {v:.3f}s" for k, v in spent.items()), flush=True)
    return row


def run_plan_calls(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``remat_pass.plan`` on ``--first-call``'s model and peak budget (device "cpu", solver
    "ilp_peak": what ``optimize`` plans there) twice in this process, against the plan cache in
    ``--plan-calls``'s directory: run the command twice for a re-plan in a new process. A repeated
    call is answered before tracing (``planning.trace_key``)."""
    import remat_pass
    from remat_pass.runtime.plan_cache import PlanCache

    model, tokens, budget = first_call_model()
    rows = []
    for call in range(2):
        cache = PlanCache(args.plan_calls)
        began = time.perf_counter()
        plan = remat_pass.plan(model, (tokens,), budget=budget, budget_kind="peak", device="cpu", solver="ilp_peak",
                               plan_cache=cache)
        rows.append({"call": call, "seconds": time.perf_counter() - began, "cache_hits": cache.hits,
                     "recompute_seconds": plan.recompute_seconds, "status": plan.status, "gap": plan.gap})
        print(f"plan() call {call}: {rows[-1]['seconds']:.3f}s, {cache.hits} hit(s), recompute "
              f"{plan.recompute_seconds:.6g}s, {plan.status}, gap {plan.gap}", flush=True)
    return rows


def _timed_phases() -> dict[str, float]:
    """Wall seconds per stage of remat_pass's own part of a call (``pipeline``'s annotate,
    plan_problem, rewrite, simulate and plan_joint_graph around them; the plan cache's key
    digest), filled in as the call runs; the rest of the call is Dynamo, AOTAutograd and the step.
    Also the seconds Python's garbage collector ran during the call, wherever it ran ("gc")."""
    import functools

    from remat_pass.planning import pipeline
    from remat_pass.runtime import plan_cache

    spent: dict[str, float] = defaultdict(float)

    def timed(module: Any, name: str) -> None:
        original = getattr(module, name)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - began

        setattr(module, name, wrapper)

    for name in ("annotate", "plan_problem", "rewrite", "simulate", "plan_joint_graph"):
        timed(pipeline, name)
    timed(plan_cache, "problem_digest")
    _time_collections(spent)
    return spent


def _time_collections(spent: dict[str, float]) -> None:
    """Add Python's cyclic collections to ``spent``: "gc" (all) and "gc_full" (the oldest generation)."""
    import gc

    started: list[float] = []

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            seconds = time.perf_counter() - started.pop()
            spent["gc"] += seconds
            if info["generation"] == 2:
                spent["gc_full"] += seconds

    gc.callbacks.append(timed)


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def peak_markdown(rows: list[dict[str, Any]], command: str) -> str:
    lines = [f"`{command}`", "",
             "| layers | values | backward steps | budget (per-block's peak) | capture s | plan s (limit) | recompute "
             "× per-block | FLOPs × per-block | status (gap) | refreshed | predicted peak ≤ budget |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        gap = "" if r["gap"] is None else f", {r['gap']:.1%}"
        lines.append(f"| {r['layers']} | {r['values']} | {r['backward_steps']} | {format_bytes(r['budget_bytes'])} "
                     f"| {r['capture_s']:.1f} | {r['plan_s']:.1f} ({r['time_limit']:g}) "
                     f"| {r['recompute_over_per_block']:.3f} | {r['flops_over_per_block']:.3f} | {r['status']}{gap} "
                     f"| {r['refreshed']} | {'yes' if r['predicted_peak_bytes'] <= r['budget_bytes'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def scaling_markdown(rows: list[dict[str, Any]], command: str) -> str:
    lines = [
        f"`{command}`", "",
        "| layers | values | keep-all | budget | capture s | annotate s | fast s | fast status (gap) | ilp s "
        "| ilp status | fast vs ilp objective |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---:|",
    ]
    for row in rows:
        fast, exact = row["fast"], row["ilp"]
        gap = fast.get("gap")
        versus = row.get("fast_vs_ilp")
        lines.append(
            f"| {row['layers']} | {row['values']} | {format_bytes(row['keep_all_bytes'])} | {row['budget_fraction']:g} "
            f"| {row['capture_s']:.1f} | {row['annotate_s']:.2f} | {fast['seconds']:.2f} "
            f"| {fast['status']}{'' if gap is None else f' ({gap:.2%})'} "
            f"| {exact.get('seconds', float('nan')):.1f} | {exact.get('status', 'not run')} "
            f"| {'n/a' if versus is None else f'{versus:+.3%}'} |")
    if any("hull_only" in row for row in rows):
        lines += ["", "Without the ILP polish and the refinement (hull + block mixing only), with and without shared blocks:",
                  "", "| layers | budget | blocks: s | gap | one group: s | gap |", "|---:|---:|---:|---:|---:|---:|"]
        for row in rows:
            if "hull_only" in row:
                a, b = row["hull_only"], row["hull_only_no_blocks"]
                lines.append(f"| {row['layers']} | {row['budget_fraction']:g} | {a['seconds']:.2f} | {a.get('gap', 0):.3%} "
                             f"| {b['seconds']:.2f} | {b.get('gap', 0):.3%} |")
    return "\n".join(lines) + "\n"


# --- Llama-2-70B ------------------------------------------------------------------------------


class HFStep(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss


def llama_model(layers: int, args: argparse.Namespace) -> nn.Module:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as error:
        raise SystemExit("--llama70b needs Hugging Face transformers: pip install transformers") from error
    config = LlamaConfig(vocab_size=args.llama_vocab, hidden_size=args.llama_hidden,
                         intermediate_size=args.llama_intermediate, num_hidden_layers=layers,
                         num_attention_heads=args.llama_heads, num_key_value_heads=8,
                         max_position_embeddings=args.llama_seq, use_cache=False, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return model.train()


def _layer_rows(plan: Plan, layer: int) -> dict[str, int]:
    """What keep-all saves inside one layer, by op (each storage once, named by the op that made it)."""
    problem = plan.problem
    keep_all = solvers.solve(problem, None, solver="keep_all")
    maker: dict[int, Any] = {}
    for value in problem.values:
        if not value.available:
            maker.setdefault(value.storage, value)
    prefix = f"model.model.layers.{layer}"
    by_op: dict[str, int] = defaultdict(int)
    for storage in {problem.values[i].storage for i in keep_all.kept}:
        base = maker[storage]
        if base.module == prefix or base.module.startswith(prefix + "."):
            where = base.module[len(prefix):].lstrip(".") or "layer"
            by_op[f"{base.op} in {where}"] += problem.storage_bytes[storage]
    return dict(sorted(by_op.items(), key=lambda item: -item[1]))


def run_llama70b(args: argparse.Namespace) -> dict[str, Any]:
    from remat_pass.tools.estimate import Policy, Workload, layer_activation_bytes
    from remat_pass.planning.plan_model import plan_with_report
    from remat_pass.tools.report import block_depth

    began = time.perf_counter()
    model = llama_model(args.llama_layers, args)
    ids = torch.zeros(1, args.llama_seq, dtype=torch.long, device="meta")
    built = time.perf_counter()
    made = plan_with_report(HFStep(model), (ids,), budget=args.llama_budget, device=args.device, solver="fast",
                            plan_cache=False)  # measure the planning, not a cached plan
    planned = time.perf_counter()
    plan, problem = made.plan, made.plan.problem
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(made.render(limit=12), flush=True)
    depth = block_depth(problem)
    layer_rows = [r for r in plan.per_module(depth) if ".layers." in r.module]
    per_layer_keep_all = sorted(r.keep_all_bytes for r in layer_rows)[len(layer_rows) // 2] if layer_rows else 0
    workload = dict(layers=args.llama_layers, hidden=args.llama_hidden, heads=args.llama_heads, seq=args.llama_seq,
                    batch=1, ffn_hidden=args.llama_intermediate, dtype="bf16")
    formula = {
        "none": layer_activation_bytes(Workload(**workload), Policy.NONE),
        "none_flash": layer_activation_bytes(Workload(**workload, flash_attention=True), Policy.NONE),
        "full": layer_activation_bytes(Workload(**workload), Policy.FULL),
    }
    # The trade-off curve at this width, and named points on it.
    hull_began = time.perf_counter()
    hull = hull_points(problem, made.step_flops, time_limit=args.fast_time_limit)
    hull_s = time.perf_counter() - hull_began
    keep_all = problem.keep_all_bytes()
    points = {}
    for name, fraction in (("5x cut", 0.2), ("2x cut", 0.5), ("3x cut", 1 / 3), ("10x cut", 0.1)):
        points[name] = _solve(problem, int(fraction * keep_all), "fast", time_limit=args.fast_time_limit)
    for name in ("per_block", "selective", "recompute_all"):
        baseline = solvers.solve(problem, None, solver=name)
        points[name] = {"kept_bytes": baseline.kept_bytes, "recompute_seconds": baseline.recompute_seconds,
                        "recompute_flops": baseline.recompute_flops}
    result = {
        "layers": args.llama_layers, "seq": args.llama_seq, "hidden": args.llama_hidden, "values": len(problem.values), "pieces": made.pieces,
        "build_s": built - began, "trace_and_plan_s": planned - built, "solve_s": plan.solve_seconds,
        "max_rss_bytes": rss, "keep_all_bytes": keep_all, "budget_fraction": args.llama_budget,
        "plan": {"status": plan.status, "gap": plan.gap, "kept_bytes": plan.kept_bytes,
                 "predicted_peak_bytes": plan.predicted_peak_bytes, "recompute_seconds": plan.recompute_seconds,
                 "recompute_flops": plan.recompute_flops},
        "step_flops": made.step_flops, "forward_seconds": made.forward_seconds,
        "per_layer_keep_all_bytes": per_layer_keep_all, "korthikanti_per_layer_bytes": formula,
        "keep_all_layer_breakdown": _layer_rows(plan, args.llama_layers // 2),
        "per_layer": [{"module": r.module, "policy": r.policy, "kept_bytes": r.kept_bytes,
                       "recompute_seconds": r.recompute_seconds} for r in layer_rows],
        "hull_s": hull_s,
        "hull": [{"kept_bytes": p.kept_bytes, "recompute_seconds": p.recompute_seconds,
                  "recompute_flops": p.recompute_flops} for p in reversed(hull)],  # keep-all first
        "points": points,
        "report": made.render(limit=100),
    }
    print(f"built in {result['build_s']:.1f}s, traced and planned in {result['trace_and_plan_s']:.1f}s "
          f"(solve {plan.solve_seconds:.2f}s), peak RSS {format_bytes(rss)}", flush=True)
    return result


def llama_markdown(result: dict[str, Any], command: str) -> str:
    step = result["step_flops"]
    keep_all = result["keep_all_bytes"]
    lines = [f"`{command}`", "",
             f"- {result['layers']} layers, sequence {result['seq']}: {result['values']} forward values in "
             f"{result['pieces']} graph(s); built {result['build_s']:.1f}s, traced + planned "
             f"{result['trace_and_plan_s']:.1f}s (solve {result['solve_s']:.2f}s); peak RSS "
             f"{format_bytes(result['max_rss_bytes'])}",
             f"- keep-all {format_bytes(keep_all)}; per layer {format_bytes(result['per_layer_keep_all_bytes'])}; "
             f"Korthikanti none {format_bytes(result['korthikanti_per_layer_bytes']['none'])}, none with "
             f"FlashAttention {format_bytes(result['korthikanti_per_layer_bytes']['none_flash'])}, full "
             f"{format_bytes(result['korthikanti_per_layer_bytes']['full'])}", "",
             "| keep-all of one layer, by op | bytes |", "|---|---:|"]
    lines += [f"| {op} | {format_bytes(nbytes)} |" for op, nbytes in result["keep_all_layer_breakdown"].items()]
    lines += ["", "| point | kept | of keep-all | recompute (h100 roofline) | recompute FLOPs | of step FLOPs |",
              "|---|---:|---:|---:|---:|---:|"]
    for name, point in result["points"].items():
        if "kept_bytes" not in point:
            lines.append(f"| {name} | {point['status']} | | | | |")
            continue
        lines.append(f"| {name} | {format_bytes(point['kept_bytes'])} | {point['kept_bytes'] / keep_all:.1%} "
                     f"| {point['recompute_seconds'] * 1e3:.1f} ms | {point['recompute_flops'] / 1e12:.1f} T "
                     f"| {point['recompute_flops'] / step:.1%} |")
    lines += ["", f"Hull ({len(result['hull'])} vertices in {result['hull_s']:.1f}s; vertices within 0.1% of keep-all "
                  "of the previous row are not shown):", "",
              "| kept | of keep-all | recompute | recompute FLOPs of step |", "|---:|---:|---:|---:|"]
    shown = None
    for point in result["hull"]:
        if shown is not None and shown - point["kept_bytes"] < keep_all / 1000 and point is not result["hull"][-1]:
            continue
        shown = point["kept_bytes"]
        lines.append(f"| {format_bytes(point['kept_bytes'])} | {point['kept_bytes'] / keep_all:.1%} "
                     f"| {point['recompute_seconds'] * 1e3:.1f} ms | {point['recompute_flops'] / step:.2%} |")
    lines += ["", "```", result["report"], "```"]
    return "\n".join(lines) + "\n"


# --- entry point ------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=_ints, default=[12, 24, 48, 96], help="GPT depths (default 12,24,48,96)")
    p.add_argument("--budgets", type=_floats, default=[0.1, 0.3, 0.5], help="fractions of keep-all (default 0.1,0.3,0.5)")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--device", default="h100", help="cost model (cpu, a100, h100, h200)")
    p.add_argument("--fast-time-limit", type=float, default=60.0)
    p.add_argument("--ilp-time-limit", type=float, default=600.0, help="0 skips the exact ILP")
    p.add_argument("--ablate-blocks", action="store_true",
                   help="also solve without ILP polish and refinement, with and without shared blocks")
    p.add_argument("--llama70b", action="store_true", help="plan the Llama-2-70B-shaped step instead of the sweep")
    p.add_argument("--llama405b", action="store_true",
                   help="Llama-3-405B's shapes instead (126 layers, hidden 16384, 128 heads, 8 KV heads, "
                        "intermediate 53248, vocab 128256, sequence 8192)")
    p.add_argument("--llama-layers", type=int, default=80)
    p.add_argument("--llama-seq", type=int, default=4096)
    p.add_argument("--llama-hidden", type=int, default=8192)
    p.add_argument("--llama-heads", type=int, default=64)
    p.add_argument("--llama-intermediate", type=int, default=28672)
    p.add_argument("--llama-vocab", type=int, default=32000)
    p.add_argument("--llama-budget", type=float, default=0.2, help="fraction of keep-all (default 0.2: a 5x cut)")
    p.add_argument("--peak", action="store_true",
                   help="the peak planner at per-block checkpointing's simulated peak, per depth, instead of the sweep")
    p.add_argument("--peak-time-limit", type=float, default=60.0,
                   help="0: optimize's default (2 s, no proof work: planning.effort.planning_effort)")
    p.add_argument("--via-plan", action="store_true",
                   help="with --peak: also remat_pass.plan() end to end (stacks stamped), then again (cached)")
    p.add_argument("--first-call", action="store_true",
                   help="the first call of optimize on a 12-layer HF GPT-2 under a peak budget, end to end")
    p.add_argument("--first-call-limits", type=_floats, default=[60.0],
                   help="explicit time limits to compare with the default (default 60)")
    p.add_argument("--one-call", type=Path, default=None, metavar="CACHE_DIR",
                   help="one first call of optimize (--first-call's model) against the plan cache in CACHE_DIR")
    p.add_argument("--plan-calls", type=Path, default=None, metavar="CACHE_DIR",
                   help="remat_pass.plan() on --first-call's model twice, against the plan cache in CACHE_DIR")
    p.add_argument("--phases", action="store_true", help="with --one-call: time remat_pass's own stages of the call")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.scaling " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {"command": command, "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "threads": torch.get_num_threads()}
    if args.llama405b:
        args.llama70b = True
        args.llama_layers, args.llama_hidden, args.llama_heads, args.llama_intermediate = 126, 16384, 128, 53248
        args.llama_vocab, args.llama_seq = 128256, 8192
    if args.llama70b:
        name = "llama405b" if args.llama405b else "llama70b"
        result = run_llama70b(args)
        (args.out / f"{name}.json").write_text(json.dumps({**meta, **result}, indent=2))
        (args.out / f"{name}.md").write_text(llama_markdown(result, command))
        print(f"wrote {args.out / (name + '.md')}")
        return
    if args.one_call is not None:
        run_one_call(args)
        return
    if args.plan_calls is not None:
        run_plan_calls(args)
        return
    if args.first_call:
        rows = run_first_call(args)
        (args.out / "first_call.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
        return
    if args.peak:
        rows = run_peak(args)
        (args.out / "peak.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
        (args.out / "peak.md").write_text(peak_markdown(rows, command))
        print(peak_markdown(rows, command))
        return
    rows = run_scaling(args)
    (args.out / "scaling.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    (args.out / "scaling.md").write_text(scaling_markdown(rows, command))
    print(scaling_markdown(rows, command))
    print(f"wrote {args.out / 'scaling.md'}")


if __name__ == "__main__":
    main()
