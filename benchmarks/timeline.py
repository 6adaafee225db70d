"""Memory timelines: the simulated live activation bytes of one step, un-rematerialized against a plan.

    python -m benchmarks.timeline --model gpt --budget 0.4 --budget-kind peak --out benchmarks/out/timeline

Traces the benchmark model once (loss included), plans it like ``optimize`` would, and draws
``remat_pass.tools.report.memory_timeline`` (the plan-level model, checked against the graph replay and
the allocator in tests/test_peak.py) with ``remat_pass.tools.plots.plot_memory_timeline``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from remat_pass.tools.explain import explain_traced
from remat_pass.planning.pipeline import trace_step
from remat_pass.tools.plots import plot_memory_timeline
from remat_pass.tools.report import memory_timeline

from .models import ModelSpec, build

PRESET_SPECS = {  # the cpu preset's sizes
    "gpt": ModelSpec("gpt", layers=4, hidden=256, heads=4, seq=256, batch=4, dropout=0.1),
    "llama": ModelSpec("llama", layers=4, hidden=256, heads=4, seq=512, batch=2),
    "resnet": ModelSpec("resnet", layers=8, hidden=32, seq=32, batch=32),
}


def draw(kind: str, budget: float, budget_kind: str, out: Path, spec: ModelSpec | None = None) -> Path:
    """Plan ``kind``'s benchmark model (or ``spec``) at ``budget``; write its timeline PNG into ``out``."""
    work = build(spec or PRESET_SPECS[kind])
    traced = trace_step(work.model, work.inputs, loss_fn=lambda output, *_: work.loss_fn(output, work.target))
    plan = explain_traced(traced, budget, budget_kind=budget_kind).plan
    out.mkdir(parents=True, exist_ok=True)
    title = f"{work.spec.label}: {budget_kind} budget {budget:g}, {plan.solver} ({plan.status})"
    return plot_memory_timeline(memory_timeline(plan), out / f"timeline_{kind}_{budget_kind}{budget:g}.png",
                                title=title)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.timeline", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(PRESET_SPECS), default="gpt")
    parser.add_argument("--budget", type=float, default=0.4, help="fraction in (0, 1] (default 0.4)")
    parser.add_argument("--budget-kind", choices=("saved", "peak"), default="peak")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/timeline"))
    args = parser.parse_args(argv)
    print(f"wrote {draw(args.model, args.budget, args.budget_kind, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
