"""Each fitting candidate's measured peak beside Inductor's own estimate of it (issue 35, item 2).

    python -m benchmarks.fit_probe                 # the 12-layer HF GPT-2 at checkpointing's peak
    python -m benchmarks.fit_probe --min-gain 0    # every candidate the fit would compile without its gain rule

The torch.compile backend fits a peak budget by compiling candidate plans with Inductor and
measuring their steps (``remat_pass.runtime.inductor_fit``). Predicting a candidate's compiled peak
instead would save those compiles. This prints, per compiled graph, the peak Inductor's scheduler
estimates for its final order (``torch._inductor.memory``), with the graph's outputs and without them
(for a backward graph the outputs are the parameter gradients, which the measurement leaves out), and
the fit's log: what each candidate was asked, modelled and measured. Raw output of one run:
``benchmarks/results/compiled_peak_probe_i35.txt``. Uses Inductor internals (private; torch 2.13).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import tempfile
from typing import Any

logger = logging.getLogger(__name__)


def _estimate(order: list[Any], name_to_buf: Any, name_to_fused_node: Any, graph_inputs: Any,
              graph_outputs: Any) -> tuple[int, int]:
    """Inductor's peak estimate of ``order``: all buffers, and without the graph's outputs."""
    import torch._inductor.memory as memory

    peak, freeable = memory.prepare_planning_info(order, name_to_buf, name_to_fused_node, graph_inputs, graph_outputs)
    timeline, _, _ = memory.compute_memory_timeline(order, freeable, graph_outputs)
    # A buffer that is never freed (end_step -1) and is not an input is one of the graph's outputs.
    internal = [b for b in timeline if b.end_step != -1 or isinstance(b.buffer, memory.FreeableInputBuffer)]
    return peak, memory.peak_memory_from_buf_info_list(internal, len(order))[0]


def report_inductor_estimates() -> None:
    """Wrap Inductor's peak-memory reordering pass so that each compiled graph logs its estimate."""
    import torch._inductor.memory as memory

    reorder = memory.reorder_for_peak_memory

    @functools.wraps(reorder)
    def reported(nodes: list[Any], name_to_buf: Any, name_to_fused_node: Any, graph_inputs: Any,
                 graph_outputs: Any, *args: Any, **kwargs: Any) -> list[Any]:
        order = reorder(nodes, name_to_buf, name_to_fused_node, graph_inputs, graph_outputs, *args, **kwargs)
        peak, without_outputs = _estimate(order, name_to_buf, name_to_fused_node, graph_inputs, graph_outputs)
        logger.info("inductor estimate: %d nodes, peak %d bytes, %d without the graph's outputs", len(order), peak,
                    without_outputs)
        return order

    memory.reorder_for_peak_memory = reported


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fit_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--min-gain", type=float, default=None, help="the fit's MIN_GAIN (default: the fit's own)")
    args = p.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="fit_probe_"))
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(relativeCreated)9.0f ms %(name)s: %(message)s"))
    for name in (__name__, "remat_pass.runtime.inductor_fit"):
        logging.getLogger(name).setLevel(logging.INFO)
        logging.getLogger(name).addHandler(handler)
    report_inductor_estimates()
    if args.min_gain is not None:
        from remat_pass.runtime import inductor_fit, peak_fitting

        peak_fitting.fit_peak = functools.partial(inductor_fit.fit_peak, min_gain=args.min_gain)
    from .planning_time import first_step

    first_step("remat", plan_cache=False)


if __name__ == "__main__":
    main()
