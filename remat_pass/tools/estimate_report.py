"""How ``remat-pass estimate`` shows an analytic plan (``estimate.LayerPlan``): rich tables.

Torch-free like the estimator itself; ``--json`` prints ``LayerPlan.to_dict()`` instead.
"""

from __future__ import annotations

from typing import Any

from .estimate import LayerPlan, format_bytes


def print_estimate(plan: LayerPlan) -> None:
    """Two rich tables: the per-policy plan and the per-GPU memory breakdown."""
    from rich.console import Console

    console = Console()
    console.print(headline(plan))
    console.print(policy_table(plan))
    console.print(memory_table(plan))
    ms = plan.step_seconds * 1e3
    console.print(f"Step (forward + backward, no recompute): {ms:.1f} ms at {plan.hardware.tflops:g} TFLOP/s; "
                  f"plan adds {plan.extra_seconds * 1e3:.1f} ms ({plan.extra_fraction:.2%}).")


def headline(plan: LayerPlan) -> str:
    """One line: the workload, its parallelism and the GPU it must fit."""
    w = plan.workload
    flags = {f"TP {w.tp}": w.tp > 1, "SP": w.sequence_parallel, "FlashAttention": w.flash_attention,
             f"ZeRO-{w.zero} over DP {w.dp}": w.zero > 0 and w.dp > 1,
             f"PP {w.pp} ({w.schedule}, {w.microbatches} micro-batches; first stage: {w.stage_layers} layers, "
             f"{float(w.in_flight):g} micro-batches in flight)": w.pp > 1}
    parallel = [name for name, on in flags.items() if on]
    return (f"[bold]{w.layers} layers[/], h={w.hidden}, a={w.heads}, s={w.seq}, b={w.batch}, {w.dtype}"
            f"{', ' + ', '.join(parallel) if parallel else ''}; {plan.parameters / 1e9:.2f}B parameters; "
            f"fits in {format_bytes(plan.hardware.memory_bytes)} per GPU")


def policy_table(plan: LayerPlan) -> Any:
    """Per policy: layers, bytes stored and rebuilt per layer, extra time."""
    from rich.table import Table

    table = Table(title="Per-layer policy (rebuilt: working set brought back in backward)")
    for header in ("policy", "layers", "stored/layer", "rebuilt", "extra/layer", "% of step"):
        table.add_column(header, justify="left" if header == "policy" else "right")
    for row in plan.rows:
        share = row.layers * row.extra_seconds / plan.step_seconds
        table.add_row(row.policy.value, str(row.layers), format_bytes(row.stored_bytes),
                      format_bytes(row.transient_bytes), f"{row.extra_seconds * 1e3:.2f} ms", f"{share:.2%}")
    captions = []
    if plan.workload.flash_attention:
        captions.append("selective omitted: FlashAttention already drops the scores")
    if plan.workload.pp > 1:
        captions.append(f"stored: for all {float(plan.workload.in_flight):g} micro-batches in flight; "
                        "times per micro-batch")
    table.caption = "; ".join(captions) or None
    return table


def memory_table(plan: LayerPlan) -> Any:
    """What one GPU holds at the peak, against its memory."""
    from rich.table import Table

    m, budget = plan.memory, plan.hardware.memory_bytes
    table = Table(title="Memory per GPU at the peak")
    table.add_column("part")
    table.add_column("bytes", justify="right")
    items = [("weights", m.weights), ("gradients", m.grads), ("optimizer state", m.optimizer),
             ("activations: layers", m.layer_activations),
             ("activations: embedding + logits", m.other_activations),
             ("activations: rebuilt layer (backward)", m.transient)]
    for name, value in items:
        table.add_row(name, format_bytes(value))
    table.add_row("[bold]total[/]", f"[bold]{format_bytes(m.total)}[/]", end_section=True)
    table.add_row("GPU memory", format_bytes(budget))
    table.add_row("headroom", format_bytes(budget - m.total))
    return table


__all__ = ["headline", "memory_table", "policy_table", "print_estimate"]
