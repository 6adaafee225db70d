"""remat_pass against torch.compile's ``activation_memory_budget`` at each point's measured peak.

Issue 13's target: "at the measured peak of every ``activation_memory_budget`` point with correct
gradients, FLOP overhead ≤ that point's, and at least 2x lower mid-curve (their budget 0.2–0.5)".
For every model this runs, through the benchmark runner (``python -m benchmarks``):

* the incumbents: ``compile_budget:dp@F`` for each point F (torch.compile with
  ``activation_memory_budget=F``, the dp knapsack, ``aot_eager_decomp_partition`` on the CPU) and
  ``checkpoint_blocks`` (per-block checkpointing; Hugging Face's own on the HF models);
* remat_pass given each incumbent's *measured* activation peak as a peak budget
  (``remat:peak:COSTS@match:POINT``), once per cost profile: ``flops`` (recompute priced by FLOPs,
  like torch's knapsack) and ``auto`` (the default, the roofline of the device the step runs on).

Each row has the allocator's activation peak, the FLOPs executed (the profiler's count for
compiled and remat rows) and the gradients against eager's. The comparison (one row per model and
point, ``comparison.json`` and ``comparison.md``) puts remat's FLOP overhead over the point's.

    python -m benchmarks.vs_memory_budget --out benchmarks/out/vs_memory_budget
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from benchmarks import cli
from benchmarks.models import HF_KINDS
from benchmarks.runner import Row

log = logging.getLogger(__name__)

POINTS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7)
MODELS = (*HF_KINDS, "gpt", "llama")
COSTS = ("flops", "auto")
PER_BLOCK = "checkpoint_blocks"
MID_CURVE = (0.2, 0.5)  # torch budgets where the issue asks for at most half the FLOP overhead
GRAD_TOLERANCE = 1e-5  # max |Δg| / max |g| against eager: fp32 rounding, not a wrong gradient
MiB = 2**20


def point_names(points: Sequence[float], per_block: bool = True) -> list[str]:
    """The incumbent strategies: per-block checkpointing, then the knapsack at each budget."""
    return ([PER_BLOCK] if per_block else []) + [f"compile_budget:dp@{p}" for p in points]


def strategy_names(points: Sequence[float], costs: Sequence[str], per_block: bool = True) -> list[str]:
    """``none``, every incumbent, and remat at each incumbent's measured peak for each cost profile."""
    incumbents = point_names(points, per_block)
    return ["none", *incumbents, *(f"remat:peak:{c}@match:{p}" for p in incumbents for c in costs)]


def target_ratio(point: str) -> float:
    """The largest remat/point FLOP-overhead ratio the issue accepts at ``point``."""
    if point == PER_BLOCK:
        return 0.5  # issue 13's first target, on the transformers
    budget = float(point.rsplit("@", 1)[1])
    return 0.5 if MID_CURVE[0] <= budget <= MID_CURVE[1] else 1.0


@dataclass(frozen=True)
class Side:
    """One measured row, as the comparison reads it."""

    status: str
    peak: int | None = None
    flop_overhead: float | None = None
    grad_scaled_diff: float | None = None
    error: str = ""

    @classmethod
    def of(cls, row: Row | None) -> "Side":
        if row is None:
            return cls("missing")
        if row.get("status") != "ok":
            return cls(str(row.get("status")), error=str(row.get("error", "")))
        return cls("ok", int(row["peak_act_bytes"]), float(row["flop_overhead"]), float(row["grad_scaled_diff"]))

    @property
    def grads_ok(self) -> bool | None:
        return None if self.grad_scaled_diff is None else self.grad_scaled_diff <= GRAD_TOLERANCE


def ratio(remat: Side, point: Side) -> float | None:
    """remat's FLOP overhead over the point's; None when either is missing or the point's is 0."""
    if remat.flop_overhead is None or not point.flop_overhead or point.flop_overhead <= 0:
        return None
    return remat.flop_overhead / point.flop_overhead


def verdict(remat: Side, point: Side, target: float) -> str:
    """"met", "missed" (with why) or "n/a" (the point itself failed or has wrong gradients)."""
    if point.status != "ok" or not point.grads_ok:
        return "n/a"
    if remat.status != "ok":
        return "missed: no plan"
    if remat.peak is not None and point.peak is not None and remat.peak > point.peak:
        return "missed: over budget"
    if not remat.grads_ok:
        return "missed: gradients"
    if point.flop_overhead is not None and point.flop_overhead <= 0:
        return "met" if (remat.flop_overhead or 0.0) <= 0 else "missed"
    value = ratio(remat, point)
    return "met" if value is not None and value <= target else "missed"


def compare(rows: Sequence[Row], points: Sequence[float], costs: Sequence[str],
            per_block: bool = True) -> list[dict[str, Any]]:
    """One record per (model, incumbent point): the point's numbers and remat's per cost profile."""
    by_key = {(row["model"], row["strategy"]): row for row in rows}
    models = list(dict.fromkeys(row["model"] for row in rows))
    out = []
    for model in models:
        none = Side.of(by_key.get((model, "none")))
        for name in point_names(points, per_block):
            point = Side.of(by_key.get((model, name)))
            target = target_ratio(name)
            record: dict[str, Any] = {"model": model, "point": name, "target_ratio": target,
                                      "none_peak": none.peak, **_prefixed("point", point)}
            for c in costs:
                remat = Side.of(by_key.get((model, f"remat:peak:{c}@match:{name}")))
                record.update(_prefixed(f"remat_{c}", remat))
                record[f"ratio_{c}"] = ratio(remat, point)
                record[f"verdict_{c}"] = verdict(remat, point, target)
            out.append(record)
    return out


def _prefixed(prefix: str, side: Side) -> dict[str, Any]:
    return {f"{prefix}_status": side.status, f"{prefix}_peak": side.peak,
            f"{prefix}_flop_overhead": side.flop_overhead, f"{prefix}_grad_scaled_diff": side.grad_scaled_diff,
            f"{prefix}_grads_ok": side.grads_ok, f"{prefix}_error": side.error}


def _point_label(name: str) -> str:
    return "per-block checkpointing" if name == PER_BLOCK else f"budget {name.rsplit('@', 1)[1]}"


def _peak(record: dict[str, Any], prefix: str) -> str:
    peak, none = record[f"{prefix}_peak"], record["none_peak"]
    if peak is None:
        return record[f"{prefix}_status"]
    return f"{peak / MiB:.2f} MiB ({peak / none:.2f})" if none else f"{peak / MiB:.2f} MiB"


def _overhead(record: dict[str, Any], prefix: str) -> str:
    value = record[f"{prefix}_flop_overhead"]
    return "" if value is None else f"{100 * value:+.1f}%"


def _grads(record: dict[str, Any], prefix: str) -> str:
    ok = record[f"{prefix}_grads_ok"]
    return "" if ok is None else ("yes" if ok else f"**no** ({record[f'{prefix}_grad_scaled_diff']:.1e})")


def markdown(records: Sequence[dict[str, Any]], costs: Sequence[str]) -> str:
    """A table per model: the point, then remat at its peak for each cost profile."""
    names = {"flops": "flops-priced", "auto": "roofline"}
    head = ["point", "its peak (× none)", "its extra FLOPs", "grads ok"]
    for c in costs:
        label = names.get(c, c)
        head += [f"remat {label}: peak", "extra FLOPs", "× point", "target"]
    head.append("remat grads ok")
    lines: list[str] = []
    for model in dict.fromkeys(r["model"] for r in records):
        lines += [f"**{model}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for record in (r for r in records if r["model"] == model):
            cells = [_point_label(record["point"]), _peak(record, "point"), _overhead(record, "point"),
                     _grads(record, "point")]
            for c in costs:
                value = record[f"ratio_{c}"]
                goal = f"≤ {record['target_ratio']:g}×: {record[f'verdict_{c}']}"
                cells += [_peak(record, f"remat_{c}"), _overhead(record, f"remat_{c}"),
                          "" if value is None else f"{value:.2f}", goal]
            cells.append(", ".join(_grads(record, f"remat_{c}") or "-" for c in costs))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def cli_argv(args: argparse.Namespace) -> list[str]:
    """The ``python -m benchmarks`` command line this run amounts to."""
    argv = ["--preset", "cpu", "--no-plots", "--out", str(args.out)]
    for model in args.model or MODELS:
        argv += ["--model", model]
    for name in ("layers", "hidden", "heads", "seq", "batch", "vocab", "warmup", "repeats"):
        argv += [f"--{name}", str(getattr(args, name))]
    argv += ["--dropout", "0", "--time-limit", str(args.time_limit),
             "--strategies", ",".join(strategy_names(args.points, args.costs, not args.no_per_block))]
    if args.remat_time_limit is not None:
        argv += ["--remat-time-limit", str(args.remat_time_limit)]
    return argv


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vs_memory_budget",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", choices=MODELS,
                        help=f"repeatable (default: {', '.join(MODELS)})")
    parser.add_argument("--points", type=cli.float_list, default=list(POINTS),
                        help="activation_memory_budget points (default: %(default)s)")
    parser.add_argument("--costs", type=cli.name_list, default=list(COSTS),
                        help="remat_pass cost profiles, one remat row each (default: flops,auto)")
    parser.add_argument("--no-per-block", action="store_true", help="leave per-block checkpointing out")
    for name, default in (("layers", 4), ("hidden", 64), ("heads", 4), ("seq", 128), ("batch", 4),
                          ("vocab", 256), ("warmup", 1), ("repeats", 1)):
        parser.add_argument(f"--{name}", type=int, default=default, help="default: %(default)s")
    parser.add_argument("--remat-time-limit", type=float, help="seconds per remat plan (default: remat_pass's)")
    parser.add_argument("--time-limit", type=float, default=120.0,
                        help="minutes in all; rows not started by then are skipped (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/vs_memory_budget"))
    return parser


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = build_parser().parse_args(argv)
    command = cli_argv(args)
    print("python -m benchmarks " + " ".join(command), flush=True)
    rows = cli.main(command)
    records = compare(rows, args.points, args.costs, not args.no_per_block)
    table = markdown(records, args.costs)
    (args.out / "comparison.json").write_text(json.dumps(records, indent=1))
    (args.out / "comparison.md").write_text(table)
    print(table)
    return records


if __name__ == "__main__":
    main()
