"""The chunked language-model loss (issue 33) on Hugging Face configs with real vocabularies.

Per model (GPT-2, vocabulary 50257; Llama, 32000; Gemma, 256000; random init, loss inside the
compiled step as ``benchmarks.models.LossOf`` spells it: ``F.cross_entropy(logits.flatten(0, -2), y)``),
each row measured on its own by ``benchmarks.runner.measure_prepared`` (allocator-level activation
peak, executed FLOPs by the profiler's count of dispatched matmuls, gradients):

* ``eager``: the model as given (the FLOP and gradient reference);
* ``ckpt``: Hugging Face's per-block checkpointing (``activation_checkpointing_enable``);
* ``min_whole`` / ``min_chunked``: remat_pass at the lowest peak it reaches, the loss whole
  (``chunk_loss=False``) and chunked (``ChunkLoss(--min-chunk-mib, gradients="recomputed", min_rows=1)``,
  1 MiB: the lowest peak wants small chunks and nothing held from forward to backward): the
  budget is the smallest one ``BudgetInfeasibleError`` names for a 1 KiB budget;
* ``at_ckpt_whole`` / ``at_ckpt_auto`` / ``at_ckpt_chunked`` / ``at_ckpt_recomputed``: remat_pass
  given ``ckpt``'s measured activation peak as a peak budget, the loss whole, ``chunk_loss=None``
  (the default rule, ``planning.loss_choice``), chunked (``--chunk-mib``, the default 16 MiB,
  gradients computed in forward: ``ChunkLoss``'s default) and chunked with the gradients
  recomputed in backward; extra FLOPs over eager's, against ``ckpt``'s;
* step time: ``keep_whole`` and ``keep_chunked`` (no budget, loss whole / chunked) in
  interleaved rounds, chunked over whole per round (median).

    python -m benchmarks.chunked_loss --out benchmarks/results/chunked_loss        # CPU, a few minutes
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

import remat_pass
from benchmarks import metrics, runner
from benchmarks.models import ModelSpec, Workload, build
from benchmarks.strategies import Prepared, Strategy, prepare, step_with_loss
from remat_pass.capture.loss_chunking import ChunkLoss, LossGradients

log = logging.getLogger(__name__)

Row = dict[str, Any]
MiB = 2**20
VOCABULARIES = {"hf_gpt2": 50257, "hf_llama": 32000, "hf_gemma": 256000}


def remat_step(work: Workload, budget: object, chunk_loss: Any, time_limit: float) -> Prepared:
    """remat_pass at a peak budget (None: keep everything, the saved fraction 1.0) with ``chunk_loss``;
    may raise BudgetInfeasibleError."""
    model = copy.deepcopy(work.model)
    params = list(model.parameters())
    started = time.perf_counter()
    kwargs: dict[str, Any] = {"budget": 1.0} if budget is None else {"budget": budget, "budget_kind": "peak"}
    optimized = remat_pass.optimize(step_with_loss(model, work.loss_fn), chunk_loss=chunk_loss, time_limit=time_limit,
                                    plan_cache=False, example_inputs=(*work.inputs, work.target), **kwargs)
    return Prepared(lambda: optimized(*work.inputs, work.target), model, params, eager=False,
                    setup_seconds=time.perf_counter() - started, plan=lambda: optimized.plan,
                    notes=list(optimized.plan.problem.notes))


def lowest_peak(work: Workload, chunk_loss: Any, time_limit: float) -> int:
    """The smallest peak budget remat_pass names when refused a 1 KiB one."""
    try:
        remat_step(work, "1KiB", chunk_loss, time_limit)
    except remat_pass.BudgetInfeasibleError as error:
        return int(error.min_bytes)
    raise AssertionError("a 1 KiB peak budget was met")


def measure(name: str, make: Callable[[], Prepared], work: Workload, cfg: runner.RunConfig,
            reference: list[torch.Tensor | None] | None) -> tuple[Row, Prepared | None]:
    runner.reset_between_rows()
    started = time.perf_counter()
    try:
        prepared = make()
        row, grads = runner.measure_prepared(prepared, work, cfg)
    except remat_pass.BudgetInfeasibleError as error:
        return {"row": name, "refused": True, "min_bytes": error.min_bytes, "error": str(error)[:300]}, None
    if reference is not None:
        diff = metrics.grad_difference(grads, reference)
        row["grad_vs_eager_scaled"], row["grad_vs_eager_rel_l2"] = diff.scaled, diff.rel_l2
    for key in ("grad_max_abs_diff", "grad_scaled_diff", "grad_rel_l2", "step_ms_all", "flops_by_op", "alloc_events"):
        row.pop(key, None)
    row.update(row=name, seconds=time.perf_counter() - started, grads=grads)
    log.info("%s: peak %.1f MiB, %.3g FLOPs, %s", name, row["peak_act_bytes"] / MiB, row["flops"], row["notes"])
    return row, prepared


def run_model(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    spec = ModelSpec(kind=kind, layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                     batch=args.batch, vocab=VOCABULARIES[kind])
    work = build(spec)
    cfg = runner.RunConfig(warmup=1, repeats=1)
    chunked = ChunkLoss(int(args.chunk_mib * MiB))
    rows: dict[str, Row] = {}
    eager, _ = measure("eager", lambda: prepare(Strategy.parse("none"), work), work, cfg, None)
    reference = eager.pop("grads")
    rows["eager"] = eager
    if not args.timing_only:
        _memory_rows(rows, work, cfg, reference, chunked, args)
    timed: dict[str, Prepared] = {}
    for name, chunk_loss in (("keep_whole", False), ("keep_chunked", chunked)):
        rows[name], timed[name] = measure(name, lambda: remat_step(work, None, chunk_loss, args.time_limit), work,
                                          cfg, reference)
    times = runner.interleaved(timed, args.rounds, torch.device("cpu"))
    for row in rows.values():
        row.pop("grads", None)
    ratios = [c / w for c, w in zip(times["keep_chunked"], times["keep_whole"])]
    return {"spec": spec.to_dict(), "rows": rows, "times_s": times, "time_ratio_median": statistics.median(ratios),
            "rounds_chunked_faster": sum(r < 1 for r in ratios)}


def _memory_rows(rows: dict[str, Row], work: Workload, cfg: runner.RunConfig, reference: Any, chunked: ChunkLoss,
                 args: argparse.Namespace) -> None:
    """The ckpt, lowest-peak and at-ckpt's-peak rows, into ``rows``."""
    rows["ckpt"], _ = measure("ckpt", lambda: prepare(Strategy.parse("checkpoint_blocks"), work), work, cfg, reference)
    lowest = () if args.skip_lowest else (
        ("min_whole", False), ("min_chunked", ChunkLoss(int(args.min_chunk_mib * MiB), LossGradients.RECOMPUTED, min_rows=1)))
    for name, chunk_loss in lowest:
        budget = lowest_peak(work, chunk_loss, args.time_limit)
        rows[name], _ = measure(name, lambda: remat_step(work, budget, chunk_loss, args.time_limit), work, cfg,
                                reference)
        rows[name]["budget_bytes"] = budget
    ckpt_peak = rows["ckpt"]["peak_act_bytes"]
    recomputed = ChunkLoss(chunked.chunk_bytes, LossGradients.RECOMPUTED)
    for name, chunk_loss in (("at_ckpt_whole", False), ("at_ckpt_auto", None), ("at_ckpt_chunked", chunked),
                             ("at_ckpt_recomputed", recomputed)):
        rows[name], _ = measure(name, lambda: remat_step(work, ckpt_peak, chunk_loss, args.time_limit), work, cfg,
                                reference)
        rows[name]["budget_bytes"] = ckpt_peak


def _loss_form(notes: str | list[str] | None) -> str:
    text = notes if isinstance(notes, str) else " ".join(notes or ())
    if "loss chunked" not in text:
        return "whole"
    return "chunked, gradients in forward" if "in forward" in text else "chunked, recomputed"


def summary(result: dict[str, Any]) -> list[str]:
    """The model's lines of the markdown tables."""
    rows = result["rows"]
    eager_flops = rows["eager"]["flops"]

    def peak(name: str) -> str:
        row = rows.get(name, {"skipped": True})
        return "skipped" if row.get("skipped") else "refused" if row.get("refused") else \
            f"{row['peak_act_bytes'] / MiB:.1f}"

    def extra(name: str) -> float | None:
        row = rows[name]
        return None if row.get("refused") else row["flops"] / eager_flops - 1

    ckpt_extra = extra("ckpt")
    lines = [f"| {result['spec']['label']} (V={result['spec']['vocab']}) | {peak('eager')} | {peak('ckpt')} | "
             f"{peak('min_whole')} | {peak('min_chunked')} | "
             + (f"{rows['min_whole']['peak_act_bytes'] / rows['min_chunked']['peak_act_bytes']:.2f}x"
                if all(n in rows and not rows[n].get("refused") for n in ("min_whole", "min_chunked")) else "n/a")
             + " |"]
    for name in ("at_ckpt_whole", "at_ckpt_auto", "at_ckpt_chunked", "at_ckpt_recomputed"):
        e = extra(name)
        ratio = "n/a" if e is None or not ckpt_extra else f"{e / ckpt_extra:.2f}"
        lines.append(f"| {result['spec']['label']} | {name} | {peak(name)} | "
                     f"{'n/a' if e is None else f'{e:+.1%}'} | {ckpt_extra:+.1%} | {ratio} | "
                     f"{_loss_form(rows[name].get('notes'))} |")
    return lines


def tables(results: dict[str, Any]) -> str:
    """The markdown tables of a run's ``results.json``."""
    lines = ["| model | eager peak MiB | ckpt peak MiB | lowest, loss whole | lowest, chunked | whole / chunked |",
             "|---|---|---|---|---|---|"]
    extra = ["| model | row (budget = ckpt's measured peak) | peak MiB | extra FLOPs | ckpt's extra FLOPs | ratio | loss |",
             "|---|---|---|---|---|---|---|"]
    times = ["| model | keep-all step, chunked / whole (median of rounds) | rounds chunked faster |", "|---|---|---|"]
    for result in results["models"].values():
        if "ckpt" in result["rows"]:  # not a --timing-only run
            first, *rest = summary(result)
            lines.append(first)
            extra.extend(rest)
        times.append(f"| {result['spec']['label']} | {result['time_ratio_median']:.3f} | "
                     f"{result['rounds_chunked_faster']}/{len(result['times_s']['keep_whole'])} |")
    return "\n".join([*lines, "", *extra, "", *times])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(VOCABULARIES), choices=list(VOCABULARIES))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--chunk-mib", type=float, default=16.0,
                        help="ChunkLoss(chunk_bytes) of the at_ckpt_chunked and keep_chunked rows (the default's)")
    parser.add_argument("--min-chunk-mib", type=float, default=1.0, help="ChunkLoss(chunk_bytes) of min_chunked")
    parser.add_argument("--time-limit", type=float, default=10.0, help="optimize(time_limit=) per plan")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-lowest", action="store_true", help="no min_whole / min_chunked rows")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tables-only", action="store_true", help="rewrite OUT/tables.md from OUT/results.json")
    parser.add_argument("--timing-only", action="store_true", help="eager and the keep-all step time rows only")
    args = parser.parse_args(argv)
    if args.tables_only:
        text = tables(json.loads((args.out / "results.json").read_text()))
        (args.out / "tables.md").write_text(text + "\n")
        print(text)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"argv": sys.argv, "torch": torch.__version__, "machine": platform.platform(), "models": {}}
    for kind in args.models:
        results["models"][kind] = run_model(kind, args)
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    text = tables(results)
    (args.out / "tables.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
