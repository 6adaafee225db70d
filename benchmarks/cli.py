"""Command line: ``python -m benchmarks --preset smoke|cpu|gpu [overrides]``.

Examples::

    python -m benchmarks --preset smoke
    python -m benchmarks --preset cpu --out benchmarks/out/cpu
    python -m benchmarks --preset gpu --device cuda --dtype bf16
    python -m benchmarks --model llama --layers 2 --hidden 128 --seq 512 \\
        --strategies none,checkpoint_blocks,sac,compile_budget:greedy@0.3,remat@0.3
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from benchmarks import report
from benchmarks.models import HF_KINDS, ModelSpec
from benchmarks.runner import Row, RunConfig, run_model
from benchmarks.strategies import Strategy, remat_optimize

BASELINES = ["none", "checkpoint_blocks", "checkpoint_sequential", "sac", "compile_mincut"]

PRESETS: dict[str, dict[str, Any]] = {
    # Seconds: the tests run this one.
    "smoke": dict(
        models=[ModelSpec("gpt", layers=2, hidden=32, heads=2, seq=16, batch=2, vocab=64, dropout=0.1)],
        strategies=["none", "checkpoint_blocks"],
        remat_budgets=[0.5], remat_match=[], remat_peak_match=[], compile_budgets=[], compile_solvers=["dp"],
        warmup=1, repeats=2, threads=1, device="cpu", dtype="fp32", time_limit=None,
    ),
    # The CPU results in RESULTS.md: about 10-15 minutes, one thread (see README).
    "cpu": dict(
        models=[
            ModelSpec("gpt", layers=4, hidden=256, heads=4, seq=256, batch=4, vocab=512, dropout=0.1),
            ModelSpec("llama", layers=4, hidden=256, heads=4, seq=512, batch=2, vocab=512),
            ModelSpec("resnet", layers=8, hidden=32, seq=32, batch=32),
        ],
        strategies=BASELINES,
        remat_budgets=[0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0],
        remat_match=["checkpoint_blocks", "checkpoint_sequential", "sac", "compile_mincut"],
        remat_peak_match=["checkpoint_blocks", "sac"],
        compile_budgets=[0.1, 0.3, 0.6], compile_solvers=["dp", "greedy", "ilp"],
        warmup=1, repeats=3, threads=1, device="cpu", dtype="fp32", time_limit=25.0,
    ),
    # One H200 in about 8 minutes (inductor compiles dominate); rows past the limit are skipped.
    "gpu": dict(
        models=[
            ModelSpec("gpt", layers=6, hidden=768, heads=12, seq=1024, batch=8, vocab=50304, dropout=0.1),
            ModelSpec("llama", layers=4, hidden=2048, heads=16, seq=2048, batch=2, vocab=32000),
            ModelSpec("resnet", layers=8, hidden=64, seq=128, batch=64),
        ],
        strategies=BASELINES,
        remat_budgets=[0.1, 0.3, 0.5, 1.0],
        remat_match=["checkpoint_blocks", "sac"], remat_peak_match=["checkpoint_blocks"],
        compile_budgets=[0.3], compile_solvers=["dp"],
        run_first=["none", "checkpoint_blocks", "sac", "remat", "compile_mincut"],
        warmup=2, repeats=5, threads=None, device="cuda", dtype="bf16", time_limit=7.5,
    ),
}

_SPEC_FIELDS = ("layers", "hidden", "heads", "seq", "batch", "dropout", "vocab")


def float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def name_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Compare activation-memory strategies (eager, checkpointing, SAC, torch.compile "
        "budgets, remat_pass) on seeded GPT-, Llama- and ResNet-style models: peak activation memory, "
        "bytes saved for backward, FLOPs (recompute included), step time, compile/plan time, gradients.",
        epilog="Strategy names: none, checkpoint_blocks, checkpoint_sequential, sac, compile_mincut, "
        "compile_budget[:dp|greedy|ilp]@F, remat[:saved|peak]@F (F in (0,1] or int bytes), "
        "remat@match:NAME (held bytes), remat:peak@match:NAME (activation peak).",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke",
                        help="sizes, strategies and sweeps to start from (default: smoke)")
    parser.add_argument("--model", action="append", choices=["gpt", "llama", "resnet", *HF_KINDS],
                        help="run only these model kinds of the preset (repeatable); a kind the "
                        "preset lacks is added at its defaults")
    for name in _SPEC_FIELDS:
        kind = float if name == "dropout" else int
        parser.add_argument(f"--{name}", type=kind, help=f"override the models' {name}")
    parser.add_argument("--strategies", type=name_list,
                        help="comma-separated strategies; replaces the preset's, which then adds "
                        "only the sweeps given explicitly below")
    parser.add_argument("--remat-budgets", type=float_list, help="remat@F sweep, e.g. 0.05,0.1,0.3,1.0")
    parser.add_argument("--remat-match", type=name_list,
                        help="also run remat with a budget of the bytes each of these strategies "
                        "measurably held for backward (e.g. checkpoint_blocks,sac)")
    parser.add_argument("--remat-peak-match", type=name_list,
                        help="also run remat with a peak budget of each of these strategies' measured "
                        "activation peak (remat_pass's budget_kind='peak')")
    parser.add_argument("--compile-budgets", type=float_list, help="compile_budget@F sweep, e.g. 0.1,0.5")
    parser.add_argument("--compile-solvers", type=name_list, help="solvers for the compile_budget sweep")
    parser.add_argument("--compile-backend",
                        help="torch.compile backend (default: aot_eager_decomp_partition on CPU, "
                        "inductor on CUDA)")
    parser.add_argument("--remat-costs", default="auto",
                        help="remat_pass's cost model for the remat rows (optimize's device=): auto (default: "
                        "the device the step runs on), cpu, a100, h100, h200, or flops (recomputed FLOPs "
                        "alone, like torch's knapsack); remat:KIND:COSTS@BUDGET sets it for one row")
    parser.add_argument("--remat-time-limit", type=float,
                        help="seconds for each remat plan (optimize's time_limit; default: remat_pass's)")
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", choices=["fp32", "bf16"])
    parser.add_argument("--warmup", type=int, help="untimed steps before timing, the first included")
    parser.add_argument("--repeats", type=int, help="timed steps (median reported)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit", type=float, help="minutes; rows not started by then are skipped")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"), help="output directory")
    parser.add_argument("--no-plots", action="store_true", help="skip the Pareto PNGs")
    parser.add_argument("-v", "--verbose", action="store_true", help="log failures with tracebacks")
    return parser


def _specs(args: argparse.Namespace, preset: dict[str, Any]) -> list[ModelSpec]:
    specs: list[ModelSpec] = list(preset["models"])
    if args.model:
        by_kind = {s.kind: s for s in specs}
        specs = [by_kind.get(kind, ModelSpec(kind)) for kind in dict.fromkeys(args.model)]
    overrides = {f: getattr(args, f) for f in _SPEC_FIELDS if getattr(args, f) is not None}
    out = []
    for spec in specs:
        fields = dict(overrides)
        if spec.kind != "gpt":  # the others have no dropout
            fields.pop("dropout", None)
        out.append(dataclasses.replace(spec, **fields))
    return out


def _strategies(args: argparse.Namespace, preset: dict[str, Any]) -> tuple[list[Strategy], str]:
    """The preset's strategies and sweeps; with --strategies, only the sweeps asked for explicitly."""
    explicit = args.strategies is not None

    def pick(name: str) -> list[Any]:
        value = getattr(args, name)
        return value if value is not None else ([] if explicit else preset[name])

    names = list(args.strategies if explicit else preset["strategies"])
    solvers = args.compile_solvers if args.compile_solvers is not None else preset["compile_solvers"]
    names += [f"compile_budget:{s}@{f}" for s in solvers for f in pick("compile_budgets")]
    optimize, why = remat_optimize()
    remat = [f"remat@{f}" for f in pick("remat_budgets")] + [f"remat@match:{n}" for n in pick("remat_match")]
    remat += [f"remat:peak@match:{n}" for n in pick("remat_peak_match")]
    if optimize is not None:
        names += remat
    else:
        names = [n for n in names if not n.startswith("remat")]
    first = preset.get("run_first", [])
    if first and not explicit:
        # Under a time limit the rows that matter most go first; the rest keep their order.
        rank = {name: i for i, name in enumerate(first)}
        names.sort(key=lambda n: rank.get(n, rank.get(n.split("@")[0].split(":")[0], len(first))))
    return [Strategy.parse(n) for n in dict.fromkeys(names)], "" if optimize is not None else why


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_name() -> str:
    """The CPU's model name, for result metadata."""
    return _cpu_name()


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR, format="%(message)s")
    preset = PRESETS[args.preset]
    device = args.device or preset["device"]
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    dtype = args.dtype or (preset["dtype"] if device == preset["device"] else "fp32")
    threads = args.threads if args.threads is not None else preset["threads"]
    if threads:
        torch.set_num_threads(threads)
    backend = args.compile_backend or ("inductor" if device == "cuda" else "aot_eager_decomp_partition")
    limit = args.time_limit if args.time_limit is not None else preset["time_limit"]
    cfg = RunConfig(
        device=device, dtype=dtype, seed=args.seed,
        warmup=args.warmup if args.warmup is not None else preset["warmup"],
        repeats=args.repeats if args.repeats is not None else preset["repeats"],
        compile_backend=backend, remat_costs=args.remat_costs, remat_time_limit=args.remat_time_limit,
    )
    specs = _specs(args, preset)
    strategies, remat_missing = _strategies(args, preset)
    meta = {
        "command": "python -m benchmarks " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                               else sys.argv[1:])),
        "preset": args.preset, "torch": torch.__version__, "python": platform.python_version(),
        "device": device, "device_name": torch.cuda.get_device_name() if device == "cuda" else _cpu_name(),
        "dtype": dtype, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "compile_backend": backend, "remat_costs": args.remat_costs, "warmup": cfg.warmup, "repeats": cfg.repeats, "seed": cfg.seed,
        "models": [s.to_dict() for s in specs], "strategies": [s.label for s in strategies],
        "remat_unavailable": remat_missing, "started": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    rows: list[Row] = []

    def on_row(row: Row) -> None:
        rows.append(row)
        status = row.get("status")
        detail = (f"act {row['peak_act_bytes'] / 2**20:8.2f} MiB  saved {row['saved_bytes'] / 2**20:8.2f} MiB  "
                  f"{row['flops'] / 1e9:8.3f} GFLOP  {row['step_ms']:8.1f} ms"
                  if status == "ok" else row.get("error", ""))
        print(f"{row['model']:<32} {row['strategy']:<36} {status:<7} {detail}", flush=True)
        report.write_all(rows, meta, args.out, plots=False)

    started = time.monotonic()
    for index, spec in enumerate(specs):
        # Each model gets its share of the time limit; what one leaves unused goes to the next.
        deadline = started + 60 * limit * (index + 1) / len(specs) if limit else None
        model_rows = run_model(spec, strategies, dataclasses.replace(cfg, deadline=deadline), on_row)
        rows[len(rows) - len(model_rows):] = model_rows  # now with ratios
    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    written = report.write_all(rows, meta, args.out, plots=not args.no_plots)
    if remat_missing:
        print(f"remat rows skipped: remat_pass.optimize not importable ({remat_missing})")
    print("wrote " + ", ".join(str(p) for p in written))
    return rows
