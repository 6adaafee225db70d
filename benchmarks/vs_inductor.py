"""remat_pass against torch.compile with Inductor, at each Inductor point's measured peak.

Users who want speed run ``torch.compile`` with Inductor, so that is the incumbent here (issue 35,
part 3), not ``aot_eager_decomp_partition`` as in ``vs_memory_budget``. For every model, with the
loss inside the compiled step, each *point* is measured on its own (``torch._dynamo.reset()``
between points):

* the incumbent, compiled with Inductor: ``default`` (no budget patched: torch's
  ``activation_memory_budget`` is 1.0, the min-cut partition), ``activation_memory_budget`` at each
  of ``--points`` (set through ``torch._functorch.config.patch`` around every call, so a
  recompile sees the same budget), or ``ckpt`` (``torch.utils.checkpoint`` around every block,
  Hugging Face's own on the HF models, compiled with Inductor);
* remat_pass given the incumbent's *measured* activation peak as a peak budget,
  ``optimize(step, budget=<bytes>, budget_kind="peak", inner=INNER)``, once per ``--inners``
  ("inductor": remat's rewritten graphs compiled by Inductor, the like-for-like; "eager": run op
  by op). ``BudgetInfeasibleError`` becomes a ``refused`` row with the smallest budget remat_pass
  found, never a dropped row.

Per row (``benchmarks.runner.measure_prepared``, as every other benchmark here): the allocator-level
activation peak, executed FLOPs (the profiler's count of dispatched aten matmul/attention ops, so
a matmul Inductor generates as its own kernel would be missed: ``flops_below_eager`` flags it), the
gradients against eager's and against the default Inductor row's. Step time: the point's rows run
in interleaved rounds (incumbent, remat inductor, remat eager, incumbent, ...); per round each
remat row's time over the incumbent's, reported as the median and the rounds it was faster in.

    python -m benchmarks.vs_inductor --out benchmarks/out/vs_inductor          # CPU
    python -m benchmarks.vs_inductor --preset gpu --out "$OUT/vs_inductor"    # one GPU, bf16
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import json
import logging
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

import remat_pass
from benchmarks import cli, metrics, runner
from benchmarks.models import HF_FAMILY_KINDS, HF_KINDS, ModelSpec, Workload, build
from benchmarks.strategies import Prepared, Strategy, checkpoint_every_block, prepare, step_with_loss

log = logging.getLogger(__name__)

Row = dict[str, Any]
DEFAULT = "default"  # torch.compile(backend="inductor") with no budget patched (torch's 1.0)
PER_BLOCK = "ckpt"  # per-block torch.utils.checkpoint, compiled with Inductor
POINTS = (0.05, 0.1, 0.3, 0.5, 1.0)
MODELS = (*HF_KINDS, "gpt")
INNERS = ("inductor", "eager")
GRAD_TOLERANCE = 1e-4  # max |Δg| / max |g|: fp32 rounding of a reordered (fused) program, not a bug
MiB = 2**20
PRESETS: dict[str, dict[str, Any]] = {
    # Small enough that ~20 Inductor compiles a model finish on a shared 2-core CPU.
    "cpu": dict(device="cpu", dtype="fp32", threads=1, layers=2, hidden=64, heads=4, seq=64, batch=2, vocab=256,
                rounds=5, remat_time_limit=None, time_limit=75.0,
                points=[DEFAULT, *map(repr, POINTS), PER_BLOCK], models=list(MODELS)),
    # One H100/H200, bf16, in the few minutes gpu_session.sh gives it: Inductor compiles (~30-60 s
    # each with Triton) dominate, so three points on the Llama and the GPT; rows past the limit
    # are recorded as skipped. More points or models: --points / --model.
    "gpu": dict(device="cuda", dtype="bf16", threads=None, layers=4, hidden=1024, heads=16, seq=1024, batch=4,
                vocab=32000, rounds=5, remat_time_limit=None, time_limit=4.0,
                points=[DEFAULT, "0.3", PER_BLOCK], models=["gpt", "hf_llama"]),
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one run uses everywhere; ``backend`` is Inductor except in the fast smoke test."""

    device: str = "cpu"
    dtype: str = "fp32"
    rounds: int = 5
    # optimize's time_limit; None (the presets) leaves remat_pass's default planning effort, what a user
    # who passes none gets. An explicit limit turns the proof work on, and its plans can land worse once
    # compiled: HF Qwen3 at torch's 0.1 point, +38.8% FLOPs at 10 s against +8.2% by default (VS_INDUCTOR.md).
    remat_time_limit: float | None = None
    backend: str = "inductor"
    inners: tuple[str, ...] = INNERS
    budget_scale: float = 1.0  # remat's budget over the incumbent's peak (below 1: a refusal test)
    deadline: float | None = None  # time.monotonic() after which no new point starts

    @property
    def run_config(self) -> runner.RunConfig:
        # One untimed step and one timed step: time comes from the interleaved rounds instead.
        return runner.RunConfig(device=self.device, dtype=self.dtype, warmup=1, repeats=1)


def incumbent(point: str, work: Workload, backend: str | Callable[..., Any] = "inductor") -> Prepared:
    """The point's step on a fresh copy of the model: ``torch.compile`` of model-with-loss."""
    import torch._functorch.config as functorch_config

    model = copy.deepcopy(work.model)
    params = list(model.parameters())
    notes = [f"torch.compile(backend={backend!r}), loss inside"]
    patches: dict[str, Any] = {}
    if point == PER_BLOCK:
        # Mutates `model` in place: checkpoint wrappers around its blocks (or HF's own).
        notes += checkpoint_every_block(work, model)
    elif point != DEFAULT:
        patches = {"activation_memory_budget": float(point)}
    compiled = torch.compile(step_with_loss(model, work.loss_fn), backend=backend)
    return Prepared(lambda: compiled(*work.inputs, work.target), model, params,
                    # patched on every call, not just the first: a recompile must see the same budget
                    context=lambda: functorch_config.patch(**patches), eager=False, notes=notes)


def remat_step(work: Workload, budget_bytes: int, inner: str, time_limit: float | None) -> Prepared:
    """remat_pass at a peak budget of ``budget_bytes``; raises BudgetInfeasibleError when refused."""
    model = copy.deepcopy(work.model)
    params = list(model.parameters())
    started = time.perf_counter()
    optimized = remat_pass.optimize(step_with_loss(model, work.loss_fn), budget=int(budget_bytes),
                                    budget_kind="peak", inner=inner, time_limit=time_limit,
                                    example_inputs=(*work.inputs, work.target),
                                    plan_cache=False)  # plan and compile: no answer from an earlier run's caches
    return Prepared(lambda: optimized(*work.inputs, work.target), model, params, eager=False,
                    setup_seconds=time.perf_counter() - started, plan=lambda: optimized.plan,
                    notes=[f"optimize(budget={int(budget_bytes)}, budget_kind='peak', inner={inner!r})"])


def measure(prepared: Prepared, work: Workload, settings: Settings,
            references: dict[str, list[torch.Tensor | None]]) -> tuple[Row, list[torch.Tensor | None]]:
    """The runner's measurements of one row, plus its gradients against each reference's."""
    row, grads = runner.measure_prepared(prepared, work, settings.run_config)
    for name, reference in references.items():
        diff = metrics.grad_difference(grads, reference)
        row[f"grad_vs_{name}_scaled"], row[f"grad_vs_{name}_max_abs"] = diff.scaled, diff.max_abs
        row[f"grad_vs_{name}_rel_l2"] = diff.rel_l2
    for key in ("grad_max_abs_diff", "grad_scaled_diff", "grad_rel_l2", "step_ms_all", "flops_by_op"):
        row.pop(key, None)  # against itself (ref=None): meaningless; by-op detail bloats the JSON
    return row, grads


def _describe(error: BaseException) -> str:
    return runner.describe_error(error)


KEEP_ALL = "keep-all"  # torch.compile's default step, timed beside every other point's rows


def _apart(backend: str) -> Callable[..., Any]:
    """The named backend behind a callable of its own. Dynamo keeps one compiled graph per code object
    and backend, and parameters are graph inputs, so a second copy of the model compiled with the same
    backend name runs the first one's graph: the keep-all step timed beside torch's 0.05 point ran the
    0.05 graph (measured 1.00x it at every point)."""
    compiler = torch._dynamo.lookup_backend(backend)
    return lambda gm, example_inputs: compiler(gm, example_inputs)


def run_point(point: str, work: Workload, settings: Settings, references: dict[str, list[torch.Tensor | None]],
              eager_flops: int, done: dict[tuple[str, int], Row]) -> list[Row]:
    """One incumbent and remat at its measured peak, measured and then timed interleaved; beside them
    torch.compile's default step (keeping everything) is timed in the same rounds, so the incumbent row
    gets ``keep_all_ratio`` (``keep_all_floor``)."""
    base: Row = {"model": work.spec.label, "model_kind": work.spec.kind, "point": point}
    rows: list[Row] = []
    live: dict[str, Prepared] = {}
    runner.reset_between_rows()
    try:
        prepared = incumbent(point, work, settings.backend)
        row, grads = measure(prepared, work, settings, references)
        rows.append({**base, "row": f"inductor:{point}", "family": "incumbent", "status": "ok", **row})
        live[rows[-1]["row"]] = prepared
        if point == DEFAULT:
            references["inductor"] = grads
        else:
            live[KEEP_ALL] = incumbent(DEFAULT, work, _apart(settings.backend))
    except Exception as error:  # noqa: BLE001 - a failing incumbent is a row, and the sweep goes on
        log.warning("%s / %s failed", work.spec.label, point, exc_info=True)
        return [{**base, "row": f"inductor:{point}", "family": "incumbent", "status": "failed",
                 "error": _describe(error)}]
    budget = int(settings.budget_scale * rows[0]["peak_act_bytes"])
    for inner in settings.inners:
        label = f"remat[{inner}]@{point}"
        head = {**base, "row": label, "family": "remat", "inner": inner, "budget_bytes": budget}
        if (inner, budget) in done:  # the same budget as an earlier point: the same plan
            earlier = done[(inner, budget)]
            rows.append({**earlier, **head, "same_as": earlier["row"], "time_ratio": None, "rounds_won": None})
            continue
        try:
            prepared = remat_step(work, budget, inner, settings.remat_time_limit)
            row, _ = measure(prepared, work, settings, references)
            rows.append({**head, "status": "ok", **row})
            live[label] = prepared
        except remat_pass.BudgetInfeasibleError as error:
            rows.append({**head, "status": "refused", "min_budget_bytes": error.min_bytes,
                         "proven_min_bytes": error.proven_min_bytes, "error": str(error)})
        except Exception as error:  # noqa: BLE001
            log.warning("%s / %s failed", work.spec.label, label, exc_info=True)
            rows.append({**head, "status": "failed", "error": _describe(error)})
        done[(inner, budget)] = rows[-1]
    for row in rows:
        if row.get("status") == "ok":
            row["flop_overhead"] = row["flops"] / eager_flops - 1 if eager_flops else None
            row["flops_below_eager"] = bool(eager_flops and row["flops"] < eager_flops)
            if row["family"] == "remat":
                row["peak_over_budget"] = row["peak_act_bytes"] / budget
    _time(rows, live, settings)
    return rows


def _time(rows: list[Row], live: dict[str, Prepared], settings: Settings) -> None:
    """Interleaved rounds of the point's live rows; remat rows get their ratio to the incumbent."""
    if len(live) < 1:
        return
    times = runner.interleaved(live, settings.rounds, torch.device(settings.device))
    first = rows[0]["row"]
    for row in rows:
        if row["row"] not in times:
            continue
        mine = times[row["row"]]
        row["step_ms"] = 1e3 * statistics.median(mine)
        row["step_ms_rounds"] = [round(1e3 * t, 3) for t in mine]
        if row["row"] != first and first in times:
            ratios = [t / r for t, r in zip(mine, times[first])]
            row["time_ratio"] = statistics.median(ratios)
            row["rounds_won"] = sum(r < 1.0 for r in ratios)
            row["rounds"] = len(ratios)
        elif row["row"] == first and KEEP_ALL in times:
            row["keep_all_ratio"] = statistics.median(k / t for k, t in zip(times[KEEP_ALL], mine))


def run_model(spec: ModelSpec, points: Sequence[str], settings: Settings,
              on_row: Callable[[Row], None] = lambda row: None) -> list[Row]:
    """Eager first (the reference gradients and FLOPs), then every point."""
    references: dict[str, list[torch.Tensor | None]] = {}
    base: Row = {"model": spec.label, "model_kind": spec.kind}
    try:  # a device without transformers fails the HF models here: a row, and the next model runs
        work = build(spec, device=settings.device, dtype=runner.RunConfig(dtype=settings.dtype).torch_dtype)
        row, grads = measure(prepare(Strategy("none"), work), work, settings, {})
    except Exception as error:  # noqa: BLE001
        log.warning("%s eager failed", spec.label, exc_info=True)
        failed = {**base, "point": "eager", "row": "eager", "family": "eager", "status": "failed",
                  "error": _describe(error)}
        on_row(failed)
        return [failed]
    references["eager"] = grads
    eager = {**base, "point": "eager", "row": "eager", "family": "eager", "status": "ok", **row, "act_ratio": 1.0}
    out = [eager]
    on_row(eager)
    done: dict[tuple[str, int], Row] = {}
    for point in points:
        if settings.deadline is not None and time.monotonic() > settings.deadline:
            skipped = {**base, "point": point, "row": f"inductor:{point}", "family": "incumbent",
                       "status": "skipped", "error": "time limit reached before this point started"}
            out.append(skipped)
            on_row(skipped)
            continue
        for row in run_point(point, work, settings, references, eager["flops"], done):
            row["act_ratio"] = row["peak_act_bytes"] / eager["peak_act_bytes"] if row.get("status") == "ok" else None
            out.append(row)
            on_row(row)
    runner.reset_between_rows()
    return out


# --- report -----------------------------------------------------------------------------------

def _mib(value: Any) -> str:
    return f"{value / MiB:.2f}" if isinstance(value, (int, float)) else "–"


def _num(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "–"


def _grad(row: Row, name: str) -> str:
    value = row.get(f"grad_vs_{name}_scaled")
    if not isinstance(value, (int, float)):
        return "–"
    return f"{value:.1e}" + ("" if value <= GRAD_TOLERANCE else " **!**")


def _cells(row: Row) -> list[str]:
    status = row.get("status")
    budget = _mib(row["budget_bytes"]) if "budget_bytes" in row else {
        "incumbent": {DEFAULT: "torch 1.0 (default)", PER_BLOCK: "per-block ckpt"}.get(row["point"], f"torch {row['point']}"),
        "eager": ""}[row["family"]]
    if status == "refused":
        detail = f"refused: smallest peak found {_mib(row.get('min_budget_bytes'))} MiB"
        return [row["row"], budget, detail, "", "", "", "", "", "", "", ""]
    if status != "ok":
        return [row["row"], budget, f"{status}: {row.get('error', '')[:120]}", "", "", "", "", "", "", "", ""]
    over = row.get("peak_over_budget")
    flops = f"{row['flops'] / 1e6:.1f}" + (f" ({100 * row['flop_overhead']:+.1f}%)"
                                           if isinstance(row.get("flop_overhead"), float) else "")
    ratio = row.get("time_ratio")
    won = f"{row['rounds_won']}/{row['rounds']}" if isinstance(row.get("rounds_won"), int) else "–"
    if row.get("same_as"):
        won = f"as {row['same_as']}"
    return [row["row"], budget, f"{_mib(row['peak_act_bytes'])} ({_num(row.get('act_ratio'), '.2f')})",
            _mib(row.get("plan_predicted_peak_bytes")), _num(over, ".2f"), flops, _num(row.get("step_ms"), ".1f"), _num(ratio, ".2f"), won,
            _grad(row, "eager"), _grad(row, "inductor")]


HEAD = ["row", "budget (remat: MiB)", "peak act MiB (× eager)", "remat predicted MiB", "peak / budget", "MFLOP (vs eager)", "step ms",
        "time × incumbent (median)", "rounds won", "grad vs eager", "grad vs inductor default"]


def _time_limit(seconds: float | None) -> str:
    return "remat_pass's default" if seconds is None else f"{seconds:g} s"


def keep_all_floor(rows: Sequence[Row], model: str) -> dict[str, float]:
    """Per point, torch.compile's default step (keeping every activation) over the point's incumbent
    step: the least ``time × incumbent`` a remat row there could reach on a step bound by its work, as
    no plan runs less than keeping everything. Timed in the point's own rounds (``keep_all_ratio``): a
    ratio of two points' medians, from other rounds, was noise on 2-ms steps, so older runs get none."""
    return {r["point"]: r["keep_all_ratio"] for r in rows
            if r["model"] == model and r.get("family") == "incumbent" and "keep_all_ratio" in r}


def markdown(rows: Sequence[Row], meta: dict[str, Any]) -> str:
    """One table per model, each point's incumbent followed by remat at its peak."""
    lines = [f"Command: `{meta['command']}`", "",
             f"torch {meta['torch']}, {meta['device']} ({meta['device_name']}), {meta['dtype']}, "
             f"{meta['threads']} thread(s); {meta['rounds']} interleaved rounds per point after one untimed "
             f"round; remat time_limit {_time_limit(meta['remat_time_limit'])}. Grad columns: max |Δg| / max |g| "
             f"(**!** above {GRAD_TOLERANCE:g}).", ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        lines += [f"**{model}**", "", "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
        lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows if r["model"] == model]
        floor = keep_all_floor(rows, model)
        if floor:
            lines += ["", "Keeping everything, over the incumbent's step (the least time × incumbent a plan can "
                      "reach where the step is bound by its work; timed in each point's rounds): "
                      + ", ".join(f"{point} {ratio:.2f}" for point, ratio in floor.items())]
        lines.append("")
    flagged = sorted({r["model"] for r in rows if r.get("flops_below_eager")})
    if flagged:
        lines.append("FLOPs below eager's (a matmul not dispatched as an aten op, e.g. generated by Inductor) on: "
                     + ", ".join(flagged))
    return "\n".join(lines) + "\n"


def write(rows: Sequence[Row], meta: dict[str, Any], out: Path) -> None:
    """JSON and markdown, rewritten after every row so an interrupted run keeps what it measured."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "vs_inductor.json").write_text(json.dumps({"meta": meta, "rows": list(rows)}, indent=1, default=str))
    (out / "vs_inductor.md").write_text(markdown(rows, meta))


# --- command line ------------------------------------------------------------------------------

def point_list(text: str) -> list[str]:
    """``default,0.05,0.3,ckpt``: names and activation_memory_budget values, in order."""
    out = []
    for item in cli.name_list(text):
        if item not in (DEFAULT, PER_BLOCK):
            value = float(item)
            if not 0.0 <= value <= 1.0:
                raise argparse.ArgumentTypeError(f"budget point {item} not in [0, 1]")
            item = repr(value)
        out.append(item)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vs_inductor", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--model", action="append", choices=(*MODELS, *HF_FAMILY_KINDS),
                        help=f"repeatable (default: {', '.join(MODELS)}; held out: {', '.join(HF_FAMILY_KINDS)})")
    parser.add_argument("--points", type=point_list,
                        help="incumbent points: default, activation_memory_budget values, ckpt (default: the "
                        f"preset's; cpu: {','.join(PRESETS['cpu']['points'])})")
    parser.add_argument("--inners", type=cli.name_list, default=list(INNERS), help="remat inner compilers")
    for name in ("layers", "hidden", "heads", "seq", "batch", "vocab", "rounds", "threads"):
        parser.add_argument(f"--{name}", type=int, help="override the preset's")
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", choices=["fp32", "bf16"])
    parser.add_argument("--remat-time-limit", type=float,
                        help="seconds per remat plan (default: remat_pass's own default effort)")
    parser.add_argument("--budget-scale", type=float, default=1.0,
                        help="remat's peak budget as a multiple of the incumbent's measured peak (default: 1)")
    parser.add_argument("--time-limit", type=float, help="minutes in all; points not started by then are skipped")
    parser.add_argument("--compile-backend", default="inductor",
                        help="the incumbents' backend (inductor; the smoke test uses aot_eager_decomp_partition)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/vs_inductor"))
    parser.add_argument("--report", type=Path, metavar="JSON",
                        help="only rewrite the markdown next to this vs_inductor.json (no measuring)")
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = build_parser().parse_args(argv)
    if args.report is not None:
        saved = json.loads(args.report.read_text())
        args.report.with_suffix(".md").write_text(markdown(saved["rows"], saved["meta"]))
        return saved["rows"]
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    preset = {**PRESETS[args.preset], **{k: v for k, v in vars(args).items() if v is not None and k in PRESETS["cpu"]}}
    if args.model:
        preset["models"] = args.model
    if preset["device"] == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    if preset["threads"]:
        torch.set_num_threads(preset["threads"])
    started = time.monotonic()
    settings = Settings(device=preset["device"], dtype=preset["dtype"], rounds=preset["rounds"],
                        remat_time_limit=preset["remat_time_limit"], backend=args.compile_backend,
                        inners=tuple(args.inners), budget_scale=args.budget_scale)
    specs = [ModelSpec(kind, **{k: preset[k] for k in ("layers", "hidden", "heads", "seq", "batch", "vocab")})
             for kind in preset["models"]]
    meta = {
        "command": "python -m benchmarks.vs_inductor " + " ".join(
            shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        "torch": torch.__version__, "python": platform.python_version(), "device": settings.device,
        "device_name": torch.cuda.get_device_name() if settings.device == "cuda" else cli.cpu_name(),
        "dtype": settings.dtype, "threads": torch.get_num_threads(), "rounds": settings.rounds,
        "remat_time_limit": settings.remat_time_limit, "backend": settings.backend, "points": preset["points"],
        "models": [s.to_dict() for s in specs], "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "activation_memory_budget_solver": _solver(),
    }
    rows: list[Row] = []

    def on_row(row: Row) -> None:
        rows.append(row)
        detail = (f"act {_mib(row['peak_act_bytes'])} MiB  {row['flops'] / 1e6:9.1f} MFLOP"
                  if row.get("status") == "ok" else str(row.get("error", ""))[:150])
        print(f"{row['model']:<28} {row['row']:<26} {row.get('status'):<8} {detail}", flush=True)
        write(rows, meta, args.out)

    for index, spec in enumerate(specs):
        limit = preset["time_limit"]
        deadline = started + 60 * limit * (index + 1) / len(specs) if limit else None
        # Rows arrive a point at a time, timed (run_point times a point after measuring it).
        run_model(spec, preset["points"], dataclasses.replace(settings, deadline=deadline), on_row)
    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    write(rows, meta, args.out)
    print(markdown(rows, meta))
    return rows


def _solver() -> str:
    with contextlib.suppress(Exception):
        import torch._functorch.config as functorch_config

        return str(functorch_config.activation_memory_budget_solver)
    return "unknown"


if __name__ == "__main__":
    main()
