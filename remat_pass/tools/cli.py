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
import contextlib
import json
import os
import sys
from typing import Any, Callable, Iterator, Mapping, Sequence

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
    _add_explain_parser(subparsers)
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

    from remat_pass.tools.demo import run_demo
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


# -- explain ---------------------------------------------------------------------------


_SOLVER_HELP = "the planner (default %(default)s); --help lists them"
_CHUNK_LOSS = ("auto", "on", "recomputed", "off")


def _chunk_loss(choice: str) -> Any:
    """``--chunk-loss`` as ``chunk_loss=``: None, a ``ChunkLoss`` or False."""
    from remat_pass.capture.loss_chunking import ChunkLoss, LossGradients

    return {"auto": None, "on": ChunkLoss(), "recomputed": ChunkLoss(gradients=LossGradients.RECOMPUTED),
            "off": False}[choice]


class _RegistryHelpFormatter(argparse.HelpFormatter):
    """``--solver``'s help lists the planner registry (``solvers.SOLVER_INFO``), read only when help is
    shown: importing the planners costs time every other command need not pay."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.dest != "solver":
            return super()._get_help_string(action)
        from remat_pass import solvers

        lines = "; ".join(info.help_line() for info in solvers.SOLVER_INFO.values()).replace("%", "%%")
        return f"the planner (default %(default)s): {lines}"


def _add_explain_parser(subparsers: Any) -> None:
    """Register ``explain``: trace a user's model and account for a plan module by module."""
    sub = subparsers.add_parser(
        "explain",
        formatter_class=_RegistryHelpFormatter,
        help="trace a model from a Python file; show per module what a budget keeps and recomputes",
        description="Trace one training step of the model FACTORY builds (nothing is trained), plan it for "
        "--budget and print per nn.Module: bytes kept, bytes recomputed, estimated recompute cost and a "
        "policy label (none / selective / full / offload).",
        epilog="FACTORY is a function in FILE.py returning (model, example_inputs) or (model, example_inputs, "
        "loss_fn); example_inputs is a tuple, one tensor or a dict of keyword inputs; loss_fn(output, *example_inputs) is traced with "
        "the model. Exit status: 0 planned, 1 planning failed (e.g. an infeasible budget), 2 bad arguments.")
    sub.add_argument("target", metavar="FILE.py:FACTORY", help="the file and the factory function in it")
    sub.add_argument("--budget", default="0.5",
                     help="fraction of keep-all in (0, 1] or a size such as 2MiB (default 0.5)")
    sub.add_argument("--solver", default="ilp", help=_SOLVER_HELP)
    sub.add_argument("--device", default="auto", help="where the step runs: auto (default: the device of its "
                     "tensors), cpu, a100, h100, h200")
    sub.add_argument("--costs", default="roofline",
                     help="how recompute is priced: roofline (default: the device's profile), flops (FLOPs alone) "
                     "or measure (each forward op timed once on the device)")
    sub.add_argument("--depth", type=_positive_int, default=None,
                     help="sum modules to their first N path parts (2: 'blocks.0'); default: innermost")
    sub.add_argument("--time-limit", type=_positive_float, default=None,
                     help="seconds a planner may spend, proving included (default: 2, no proof work)")
    sub.add_argument("--plan-cache", default=None, metavar="DIR",
                     help="where solved plans are cached (default ~/.cache/remat_pass/plans), or 'off'")
    sub.add_argument("--prove", action="store_true",
                     help="do the proof work (exact rows, the any-schedule bound) within --time-limit "
                     "(default 60 with --prove): a tighter proven gap, planning takes the limit")
    sub.add_argument("--budget-kind", choices=("auto", "saved", "peak"), default="auto",
                     help="what the budget bounds: saved bytes or the step's peak (auto: a fraction bounds "
                     "saved bytes, a size the peak)")
    sub.add_argument("--offload", action="store_true",
                     help="let the planner also send saved activations to host memory (needs a --device with a "
                     "host link: a100, h100, h200); modules that do are labelled 'offload'")
    sub.add_argument("--chunk-loss", choices=_CHUNK_LOSS, default="auto",
                     help="compute a language-model loss (linear head + cross_entropy) in chunks of tokens: auto "
                     "(default: where the budget needs it or it saves work), on (its gradients computed in forward), "
                     "recomputed (on, the logits recomputed in backward instead: the lowest peak), off")
    sub.add_argument("--json", action="store_true", help="print a machine-readable dict instead of the table")
    sub.add_argument("--plot", metavar="DIR", default=None,
                     help="also sweep budgets and write DIR/pareto.png (needs matplotlib)")
    sub.set_defaults(handler=_run_explain, usage_error=sub.error)


def _load_factory(target: str) -> tuple[Any, tuple[Any, ...] | dict[str, Any], Any]:
    """Import FILE.py, call FACTORY(), check what it returned; _UsageError on anything wrong."""
    import importlib.util
    from pathlib import Path

    import torch

    file_text, colon, name = target.rpartition(":")
    if not colon or not file_text or not name.isidentifier():
        raise _UsageError(f"expected FILE.py:FACTORY, got {target!r}")
    path = Path(file_text)
    if not path.is_file():
        raise _UsageError(f"no such file: {file_text}")
    module_name = f"_remat_pass_factory_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise _UsageError(f"cannot import {file_text} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)  # so that the file can import its neighbours
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file: report it in one line
        raise _UsageError(f"importing {file_text} failed: {_one_line(e)}") from e
    finally:
        sys.path.remove(folder)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise _UsageError(f"{file_text} has no function {name!r}")
    try:
        made = factory()
    except Exception as e:  # noqa: BLE001
        raise _UsageError(f"{name}() failed: {_one_line(e)}") from e
    shape = "(model, example_inputs) or (model, example_inputs, loss_fn)"
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise _UsageError(f"{name}() must return {shape}, got {type(made).__name__}"
                          f"{f' of length {len(made)}' if isinstance(made, tuple) else ''}")
    model, inputs, loss_fn = (*made, None) if len(made) == 2 else made
    if not isinstance(model, torch.nn.Module):
        raise _UsageError(f"{name}() must return {shape}; its model is a {type(model).__name__}, not an nn.Module")
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else inputs
    if isinstance(inputs, Mapping):  # keyword inputs (a Hugging Face batch): trace_step takes them as such
        return model, dict(inputs), loss_fn
    if not isinstance(inputs, (tuple, list)):
        raise _UsageError(f"{name}() must return {shape}; example_inputs is a {type(inputs).__name__}, "
                          "not a tuple, a tensor or a dict")
    if loss_fn is not None and not callable(loss_fn):
        raise _UsageError(f"{name}() must return {shape}; loss_fn is a {type(loss_fn).__name__}, not callable")
    return model, tuple(inputs), loss_fn


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _run_explain(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from remat_pass import solvers
    from remat_pass.planning.budget import parse_budget
    from remat_pass.annotate.costs import get_profile, parse_costs
    from remat_pass.errors import BudgetInfeasibleError, InvalidBudgetError, RematError
    from remat_pass.tools.explain import explain, explain_step
    from remat_pass.rewrite.offload import check_offload_options

    logging.basicConfig(level=logging.WARNING)
    try:
        budget = parse_budget(_budget_argument(args.budget))
        get_profile(args.device)
        parse_costs(args.costs)
        check_offload_options(args.offload, args.device, args.solver)
    except (InvalidBudgetError, ValueError) as e:
        raise _UsageError(str(e)) from e
    try:
        solvers.get_solver(args.solver)
    except ValueError as e:
        raise _UsageError(str(e)) from e
    model, inputs, loss_fn = _load_factory(args.target)
    options: dict[str, Any] = {"budget_kind": args.budget_kind}
    if args.time_limit is not None:
        options["time_limit"] = args.time_limit
    if args.prove:
        options["prove"] = True
    if args.plan_cache is not None:
        from remat_pass.runtime.plan_cache import from_text

        options["plan_cache"] = from_text(args.plan_cache)
    try:
        with _stdout_to_stderr():
            # As explain() does: identical blocks traced once each and stamped, the loss's chunking chosen.
            call = dict(depth=args.depth, costs=args.costs, offload=args.offload,
                        chunk_loss=_chunk_loss(args.chunk_loss), **options)
            if args.plot is None:  # a repeated command is answered before tracing (planning.trace_key)
                explanation = explain(model, inputs, budget, args.solver, args.device, loss_fn=loss_fn, **call)
            else:  # the plots' curve needs the traced step
                traced, explanation = explain_step(model, inputs, budget, args.solver, args.device, loss_fn=loss_fn,
                                                   **call)
    except BudgetInfeasibleError as e:
        if args.json:
            print(json.dumps({"error": "infeasible", "message": str(e), "budget_bytes": e.budget_bytes,
                              "min_feasible_bytes": e.min_bytes, "keep_all_bytes": e.keep_all_bytes}, indent=2))
        else:
            print(f"{PROG} explain: {e}", file=sys.stderr)
        return 1
    except RematError as e:
        print(f"{PROG} explain: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # e.g. --offload on a device without a host link
        raise _UsageError(str(e)) from e
    written: list[str] = []
    if args.plot is not None:
        try:
            with _stdout_to_stderr():
                written = _explain_plots(traced, explanation, budget, args.solver, Path(args.plot), options)
        except (ImportError, OSError) as e:
            print(f"{PROG} explain: could not write plots: {e}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps({**explanation.to_dict(), "pieces": explanation.pieces, "plots": written}, indent=2))
    else:
        explanation.show()
        for path in written:
            print(f"wrote {path}")
    return 0


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send whatever native code prints (HiGHS's banner) to stderr: stdout carries only our output."""
    sys.stdout.flush()
    try:
        stdout_fd, stderr_fd = sys.stdout.fileno(), sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (captured in tests): nothing to guard
        yield
        return
    saved = os.dup(stdout_fd)
    try:
        os.dup2(stderr_fd, stdout_fd)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, stdout_fd)
        os.close(saved)


def _explain_plots(traced: Any, explanation: Any, budget: Any, solver: str, folder: Any,
                   options: dict[str, Any]) -> list[str]:
    """The Pareto curve of a budget sweep, and the simulated memory timeline against keep-all."""
    from remat_pass.tools.plots import plot_memory_timeline, plot_pareto
    from remat_pass.tools.report import memory_timeline
    from remat_pass.tools.tradeoff import DEFAULT_BUDGETS, sweep_traced

    budgets = DEFAULT_BUDGETS if budget.fraction in DEFAULT_BUDGETS else (*DEFAULT_BUDGETS, budget)
    # the trade-off curve is over saved bytes, whatever the budget of the explained plan bounds
    sweep_options = {k: v for k, v in options.items() if k not in ("budget_kind", "prove", "plan_cache")}
    curve = sweep_traced(traced, budgets, solver, **sweep_options)
    written = [str(plot_pareto(curve, folder / "pareto.png", highlight=explanation.plan))]
    series = memory_timeline(explanation.plan)
    written.append(str(plot_memory_timeline(series, folder / "memory_timeline.png")))
    return written


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
    from remat_pass.tools.estimate import parse_bytes

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
            "No tracing; see remat_pass/tools/estimate.py for the formulas and cost model."),
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
    setup.add_argument("--pp", type=_positive_int, default=1,
                       help="pipeline-parallel stages p; figures are the first stage's, which holds the most "
                            "(default 1)")
    setup.add_argument("--microbatches", type=_positive_int, default=1,
                       help="micro-batches m per step through the pipeline (default 1)")
    setup.add_argument("--schedule", choices=("1f1b", "interleaved"), default="1f1b",
                       help="pipeline schedule: 1f1b holds min(p, m) micro-batches in flight on the first stage, "
                            "interleaved p*(1 + (p-1)/(p*v)) (default 1f1b)")
    setup.add_argument("--virtual-stages", type=_positive_int, default=None,
                       help="model chunks per stage v for --schedule interleaved (default 2 there, else 1)")
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
    from remat_pass.tools.estimate import Hardware, DoesNotFitError, Workload, plan_layers

    try:
        workload = Workload(
            layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, batch=args.batch,
            vocab=args.vocab, ffn_hidden=args.ffn_hidden, dtype=args.dtype, tp=args.tp,
            sequence_parallel=args.sequence_parallel, flash_attention=args.flash_attention,
            dp=args.dp, zero=args.zero, pp=args.pp, microbatches=args.microbatches, schedule=args.schedule,
            virtual_stages=args.virtual_stages or (2 if args.schedule == "interleaved" else 1))
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
        from remat_pass.tools.estimate_report import print_estimate

        print_estimate(plan)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
