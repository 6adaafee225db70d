"""The ``remat-pass`` command line.

Each subcommand is a pair: ``_add_<name>_parser(subparsers)`` declares its options and sets
``handler``; ``_run_<name>(args) -> int`` does the work. Adding a command is one new pair and
one line in :func:`build_parser`. Nothing heavy is imported at module level, so that
``remat-pass estimate`` (pure arithmetic) starts without loading torch; commands import what
they need inside their handler.

    $ remat-pass estimate --layers 80 --hidden 8192 --heads 64 --seq 8192 --gpu-memory 80GB \\
        --tp 8 --sequence-parallel --dp 8 --zero 1
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from remat_pass.estimate import LayerPlan

PROG = "remat-pass"


class _UsageError(Exception):
    """Bad combination of arguments; reported through the subcommand's argparse ``error``."""


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Budgeted activation rematerialization for PyTorch training steps.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_estimate_parser(subparsers)
    _add_demo_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``remat-pass`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except _UsageError as e:
        args.usage_error(str(e))  # prints "usage: ... error: ..." and exits with status 2
        raise AssertionError("unreachable") from e


# -- demo ------------------------------------------------------------------------------


def _add_demo_parser(subparsers: Any) -> None:
    sub = subparsers.add_parser(
        "demo",
        help="optimize a built-in GPT-style model and show the plan and the memory it saves",
        description="One training step of a built-in GPT-style decoder (random init), eager and "
        "through remat_pass.optimize, with measured bytes saved for backward and a gradient check.",
    )
    sub.add_argument("--budget", default="0.3", help="fraction in (0, 1] or a size such as 2MiB (default 0.3)")
    sub.add_argument("--layers", type=_positive_int, default=4)
    sub.add_argument("--hidden", type=_positive_int, default=128)
    sub.add_argument("--heads", type=_positive_int, default=4)
    sub.add_argument("--seq", type=_positive_int, default=128)
    sub.add_argument("--batch", type=_positive_int, default=4)
    sub.set_defaults(handler=_run_demo, usage_error=sub.error)


def _budget_argument(text: str) -> object:
    try:
        return float(text) if "." in text and text.replace(".", "", 1).isdigit() else int(text)
    except ValueError:
        return text  # a size string; parse_budget says what is wrong with it


def _run_demo(args: argparse.Namespace) -> int:
    import logging

    from remat_pass.demo import run_demo
    from remat_pass.errors import RematError
    from remat_pass.examples import GPTConfig

    logging.basicConfig(level=logging.WARNING)
    if args.hidden % args.heads:
        raise _UsageError(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    config = GPTConfig(seq_len=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads)
    try:
        result = run_demo(_budget_argument(args.budget), config, batch=args.batch)
    except RematError as error:
        print(f"{PROG} demo: {error}", file=sys.stderr)
        return 1
    print(result.report())
    return 0


# -- estimate --------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    value = _parse_number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    value = _parse_number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = _parse_number(text, float)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    value = _parse_number(text, float)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a non-negative number, got {text!r}")
    return value


def _parse_number(text: str, kind: Callable[[str], Any]) -> Any:
    try:
        return kind(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from e


def _byte_size(text: str) -> int:
    from remat_pass.estimate import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _add_estimate_parser(subparsers: Any) -> None:
    """Register ``estimate``: the analytic, torch-free per-layer policy planner."""
    sub = subparsers.add_parser(
        "estimate",
        help="plan per-layer recompute/offload for a GPT-style model from its shape alone",
        description=(
            "Predict per-GPU memory of a GPT-style training step (Korthikanti et al. 2022 activation "
            "formulas, mixed-precision Adam state) and pick for each layer none / selective / full "
            "recompute / offload so that it fits --gpu-memory with the least extra time. "
            "No tracing; see remat_pass/estimate.py for the formulas and cost model."),
        epilog="Sizes: GB/MB are powers of 10, GiB/MiB powers of 2 (an '80GB' H100 holds about 79.6GiB). "
               "Exit status: 0 plan found, 1 nothing fits, 2 bad arguments.")
    shape = sub.add_argument_group("model shape")
    shape.add_argument("--layers", type=_positive_int, required=True, help="transformer layers L")
    shape.add_argument("--hidden", type=_positive_int, required=True, help="hidden size h")
    shape.add_argument("--heads", type=_positive_int, required=True, help="attention heads a")
    shape.add_argument("--seq", type=_positive_int, required=True, help="sequence length s")
    shape.add_argument("--batch", type=_positive_int, default=1, help="micro-batch size b (default 1)")
    shape.add_argument("--vocab", type=_non_negative_int, default=0,
                       help="vocabulary size V; adds embeddings and fp32 logits (default 0: left out)")
    shape.add_argument("--ffn-hidden", type=_positive_int, default=None,
                       help="MLP inner size F (default 4*hidden)")
    setup = sub.add_argument_group("training setup")
    setup.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                       help="activation/weight precision (default bf16; 16-bit uses mixed-precision Adam)")
    setup.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size t (default 1)")
    setup.add_argument("--sequence-parallel", action="store_true",
                       help="Megatron sequence parallelism: shard the TP-replicated activations by t")
    setup.add_argument("--flash-attention", action="store_true",
                       help="attention never stores the s*s scores (makes 'selective' redundant)")
    setup.add_argument("--dp", type=_positive_int, default=1, help="data-parallel size for --zero (default 1)")
    setup.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                       help="ZeRO stage: shard optimizer (1), +grads (2), +weights (3) over --dp (default 0)")
    device = sub.add_argument_group("device")
    device.add_argument("--gpu-memory", type=_byte_size, required=True,
                        help="memory per GPU, with a unit: 80GB, 79.6GiB, 24000MiB")
    device.add_argument("--tflops", type=_positive_float, default=400.0,
                        help="achieved dense TFLOP/s per GPU (default 400, bf16 on an H100-class part)")
    device.add_argument("--pcie-gbps", type=_non_negative_float, default=25.0,
                        help="host link in GB/s (gigaBYTES) per direction for offload; 0 disables offload "
                             "(default 25)")
    device.add_argument("--hbm-tbps", type=_positive_float, default=3.35,
                        help="HBM bandwidth in TB/s, prices the softmax traffic of selective recompute "
                             "(default 3.35)")
    sub.add_argument("--json", action="store_true", help="print a machine-readable dict instead of tables")
    sub.set_defaults(handler=_run_estimate, usage_error=sub.error)


def _run_estimate(args: argparse.Namespace) -> int:
    from remat_pass.estimate import Hardware, DoesNotFitError, Workload, plan_layers

    try:
        workload = Workload(
            layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, batch=args.batch,
            vocab=args.vocab, ffn_hidden=args.ffn_hidden, dtype=args.dtype, tp=args.tp,
            sequence_parallel=args.sequence_parallel, flash_attention=args.flash_attention,
            dp=args.dp, zero=args.zero)
        hardware = Hardware(memory_bytes=args.gpu_memory, tflops=args.tflops,
                            pcie_gbps=args.pcie_gbps, hbm_tbps=args.hbm_tbps)
    except ValueError as e:
        raise _UsageError(str(e)) from e
    try:
        plan = plan_layers(workload, hardware)
    except DoesNotFitError as e:
        if args.json:
            print(json.dumps({"error": "does_not_fit", "message": str(e), "needed_bytes": e.needed_bytes,
                              "budget_bytes": e.budget_bytes, "state_bytes": e.state_bytes}, indent=2))
        else:
            print(f"{PROG} estimate: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        _print_plan(plan)
    return 0


def _print_plan(plan: LayerPlan) -> None:
    """Two rich tables: the per-policy plan and the per-GPU memory breakdown."""
    from rich.console import Console

    console = Console()
    console.print(_headline(plan))
    console.print(_policy_table(plan))
    console.print(_memory_table(plan))
    ms = plan.step_seconds * 1e3
    console.print(f"Step (forward + backward, no recompute): {ms:.1f} ms at {plan.hardware.tflops:g} TFLOP/s; "
                  f"plan adds {plan.extra_seconds * 1e3:.1f} ms ({plan.extra_fraction:.2%}).")


def _headline(plan: LayerPlan) -> str:
    from remat_pass.estimate import format_bytes

    w = plan.workload
    flags = {f"TP {w.tp}": w.tp > 1, "SP": w.sequence_parallel, "FlashAttention": w.flash_attention,
             f"ZeRO-{w.zero} over DP {w.dp}": w.zero > 0 and w.dp > 1}
    parallel = [name for name, on in flags.items() if on]
    return (f"[bold]{w.layers} layers[/], h={w.hidden}, a={w.heads}, s={w.seq}, b={w.batch}, {w.dtype}"
            f"{', ' + ', '.join(parallel) if parallel else ''}; {plan.parameters / 1e9:.2f}B parameters; "
            f"fits in {format_bytes(plan.hardware.memory_bytes)} per GPU")


def _policy_table(plan: LayerPlan) -> Any:
    from rich.table import Table

    from remat_pass.estimate import format_bytes

    table = Table(title="Per-layer policy (rebuilt: working set brought back in backward)")
    for header in ("policy", "layers", "stored/layer", "rebuilt", "extra/layer", "% of step"):
        table.add_column(header, justify="left" if header == "policy" else "right")
    for row in plan.rows:
        share = row.layers * row.extra_seconds / plan.step_seconds
        table.add_row(row.policy.value, str(row.layers), format_bytes(row.stored_bytes),
                      format_bytes(row.transient_bytes), f"{row.extra_seconds * 1e3:.2f} ms", f"{share:.2%}")
    if plan.workload.flash_attention:
        table.caption = "selective omitted: FlashAttention already drops the scores"
    return table


def _memory_table(plan: LayerPlan) -> Any:
    from rich.table import Table

    from remat_pass.estimate import format_bytes

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


if __name__ == "__main__":
    raise SystemExit(main())
