"""Does recomputing a free value whose backward reader is a matmul cost time under Inductor?

``planning.fused_free`` leaves such a value kept: Inductor cannot fuse a recompute into an extern
kernel, so it would run as a kernel of its own in backward. This measures that choice on a
model made to have one (a pointwise ``sin`` of a buffer read by the weight gradient's matmul,
beside a ``cos`` read by a multiplication, which is moved either way): the step as planned
(``kept``) against the step with the rule off (``recomputed``), interleaved, thread CPU time.

    python -m benchmarks.fused_free_extern --rows 512 --width 1024 --rounds 31
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import remat_pass
from remat_pass.planning import fused_free


class BufferFed(nn.Module):
    def __init__(self, rows: int, width: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.register_buffer("b", torch.randn(rows, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((self.b.sin() @ self.w) * x * self.b.cos()).sum()


def _step(rows: int, width: int, extern_rule: bool):
    torch.manual_seed(0)
    model = BufferFed(rows, width)
    x = torch.randn(rows, width, requires_grad=True)
    saved = fused_free.fuses_into_backward
    if not extern_rule:
        fused_free.fuses_into_backward = lambda annotated, plan, i: True
    try:
        optimized = remat_pass.optimize(model, budget=1.0, budget_kind="saved", inner="inductor")
        optimized(x).backward()
    finally:
        fused_free.fuses_into_backward = saved

    def step() -> None:
        model.w.grad = x.grad = None
        optimized(x).backward()
    names = [optimized.plan.problem.values[i].op.split(".")[0] for i in optimized.plan.recomputed]
    return step, names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=31)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = {"kept": _step(args.rows, args.width, True), "recomputed": _step(args.rows, args.width, False)}
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, (step, _) in rows.items():
            started = time.thread_time()
            step()
            times[name].append(time.thread_time() - started)
    for name, (_, recomputed) in rows.items():
        print(f"| {name} | {sorted(recomputed)} | {1e3 * statistics.median(times[name]):.3f} |")


if __name__ == "__main__":
    main()
