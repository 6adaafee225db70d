"""Qwen3 (h64) at torch's 0.1 point planned with time_limit=10: the buffers Inductor's own estimate holds at its
peak, per compiled graph of each fitting candidate (Inductor internals: torch._inductor.memory; torch 2.13).

    PYTHONPATH=. python benchmarks/results/vs_inductor_families_default_effort/qwen3_peak_dump.py \
        > benchmarks/results/vs_inductor_families_default_effort/qwen3_peak_dump.txt

Per graph: Inductor's estimated peak (the graph's outputs left out), the node running at it, and the 25 largest
live buffers with their steps [made, last read] and the FX nodes their kernel came from.
"""

import functools
import logging

import torch
import torch._inductor.memory as memory

import remat_pass
from benchmarks.models import ModelSpec, build
from benchmarks.strategies import step_with_loss

REORDER = memory.reorder_for_peak_memory


def origins(snode) -> list[str]:
    node = getattr(snode, "node", None)
    return sorted({o.name for o in getattr(node, "origins", ())})[:6]


@functools.wraps(REORDER)
def dumped(nodes, name_to_buf, name_to_fused_node, graph_inputs, graph_outputs, *args, **kwargs):
    order = REORDER(nodes, name_to_buf, name_to_fused_node, graph_inputs, graph_outputs, *args, **kwargs)
    _, freeable = memory.prepare_planning_info(order, name_to_buf, name_to_fused_node, graph_inputs, graph_outputs)
    timeline, _, buf_to_snode = memory.compute_memory_timeline(order, freeable, graph_outputs)
    internal = [b for b in timeline if b.end_step != -1 or isinstance(b.buffer, memory.FreeableInputBuffer)]
    peak, per_step = memory.peak_memory_from_buf_info_list(internal, len(order))
    step = max(range(len(per_step)), key=per_step.__getitem__)
    live = [b for b in internal if b.start_step <= step <= b.end_step]
    running = order[min(step, len(order) - 1)]
    print(f"graph of {len(order)} nodes: peak {peak} bytes at step {step} ({running.get_name()} {origins(running)}), "
          f"{len(live)} buffers live", flush=True)
    for b in sorted(live, key=lambda b: -b.size_alloc)[:25]:
        made_by = buf_to_snode.get(b.buffer)
        print(f"  {b.buffer.get_name():>14} {b.size_alloc:>9} [{b.start_step},{b.end_step}] "
              f"{origins(made_by) if made_by is not None else type(b.buffer).__name__}")
    return order


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("remat_pass.runtime.inductor_fit").setLevel(logging.INFO)
    torch.set_num_threads(1)
    memory.reorder_for_peak_memory = dumped
    work = build(ModelSpec("hf_qwen3", 2, 64, 4, 64, 2, vocab=256))
    step = remat_pass.optimize(step_with_loss(work.model, work.loss_fn), budget=2811016, budget_kind="peak",
                               inner="inductor", time_limit=10, example_inputs=(*work.inputs, work.target),
                               plan_cache=False)
    step(*work.inputs, work.target).backward()


if __name__ == "__main__":
    main()
