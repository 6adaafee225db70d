"""Run strategies on workloads and collect one row of metrics per (model, strategy, budget)."""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

from benchmarks import metrics
from remat_pass.runtime import measure
from benchmarks.models import ModelSpec, Workload, build
from benchmarks.strategies import Options, Prepared, Strategy, prepare

log = logging.getLogger(__name__)

Row = dict[str, Any]


@dataclass(frozen=True)
class RunConfig:
    device: str = "cpu"
    dtype: str = "fp32"
    seed: int = 0
    warmup: int = 1
    repeats: int = 3
    compile_backend: str = "aot_eager_decomp_partition"
    remat_costs: str = "auto"  # remat_pass's cost profile (optimize's device=) for remat rows
    remat_time_limit: float | None = None  # optimize's time_limit= for remat rows; None: its default
    deadline: float | None = None  # time.monotonic() after which no new row starts

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16}[self.dtype]


@dataclass
class _Reference:
    grads: list[torch.Tensor | None]
    loss_saved_bytes: int
    loss_held_bytes: int


def _dynamo_graphs() -> int:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(sum(counters["stats"].values())) if "stats" in counters else 0


def _loss_saved_bytes(model: torch.nn.Module, work: Workload, device: torch.device) -> tuple[int, int]:
    """(hooked, held) bytes the loss function alone saves: the same in every row, outside the model."""
    with torch.no_grad():
        logits = model(*work.inputs)
    logits.requires_grad_(True)
    hooked = metrics.saved_bytes(lambda: work.loss_fn(logits, work.target), exclude=[logits, work.target])
    loss, held = measure.held_bytes(lambda: work.loss_fn(logits, work.target), device)
    del loss
    return hooked, held


def _measure(
    prepared: Prepared, work: Workload, cfg: RunConfig, ref: _Reference | None
) -> tuple[Row, list[torch.Tensor | None]]:
    device = torch.device(cfg.device)
    exclude = [*prepared.model.parameters(), *prepared.model.buffers(), *work.inputs, work.target]
    row: Row = {}

    prepared.zero_grad()
    _, first = metrics.timed_once(prepared.step, device)
    for _ in range(max(cfg.warmup - 1, 0)):
        prepared.zero_grad()
        prepared.step()
    graphs_after_first = _dynamo_graphs()

    def step() -> torch.Tensor:
        prepared.zero_grad()
        return prepared.step()

    times = metrics.time_calls(step, cfg.repeats, device)
    row["step_ms"] = 1e3 * metrics.median(times)
    row["step_ms_all"] = [round(1e3 * t, 3) for t in times]
    row["first_step_ms"] = 1e3 * first
    row["compile_s"] = prepared.setup_seconds + max(first - metrics.median(times), 0.0)

    # Gradients of one seeded step; with the same seed eager dropout masks agree.
    prepared.zero_grad()
    torch.manual_seed(cfg.seed + 1)
    row["loss"] = float(prepared.step())
    grads = [None if p.grad is None else p.grad.detach().clone() for p in prepared.params]
    diff = metrics.grad_difference(grads, ref.grads if ref is not None else grads)
    row["grad_max_abs_diff"], row["grad_scaled_diff"], row["grad_rel_l2"] = diff.max_abs, diff.scaled, diff.rel_l2
    row["rng_matches_eager"] = prepared.rng_matches_eager

    prepared.zero_grad()
    timeline = measure.allocator_peak(prepared.step, device, lambda: [p.grad for p in prepared.params])
    row["peak_bytes"] = timeline.peak
    row["peak_act_bytes"] = timeline.peak_excluding
    row["grad_bytes"] = metrics.storage_bytes([p.grad for p in prepared.params if p.grad is not None])
    row["end_bytes"] = timeline.end
    # What the step left allocated besides the gradients (0 unless something leaks or caches).
    row["leftover_bytes"] = timeline.end - row["grad_bytes"]
    row["alloc_events"] = timeline.events
    if device.type == "cuda":
        prepared.zero_grad()
        row["cuda_peak_bytes"] = metrics.cuda_peak_bytes(prepared.step, device)

    prepared.zero_grad()
    with prepared.recording(), prepared.context():
        box: list[torch.Tensor] = []
        hooked = metrics.saved_bytes(lambda: box.append(prepared.forward()), exclude)
        extra = prepared.extra_saved_bytes(exclude)
        box.clear()
    row["saved_bytes"] = hooked + extra
    with prepared.context():
        loss, row["held_bytes"] = measure.held_bytes(prepared.forward, device)
        del loss

    # Two FLOP counters, each blind somewhere: FlopCounterMode cannot see compiled graphs (dynamo
    # runs the frame eagerly under a dispatch mode); the profiler also counts ops that SAC answers
    # from its cache without computing. Use each where it sees what ran; keep both for comparison.
    prepared.zero_grad()
    counted = metrics.executed_flops(prepared.step)
    row["flops_profiler"] = counted.total
    row["flops_by_op"] = counted.by_op
    if counted.uncounted:
        prepared.notes.append("FLOPs not counted for " + ", ".join(counted.uncounted))
    if prepared.eager:
        prepared.zero_grad()
        row["flops_dispatch"] = metrics.dispatch_flops(prepared.step)
    row["flops"] = row["flops_dispatch"] if prepared.eager else counted.total
    row["flops_method"] = "FlopCounterMode" if prepared.eager else "profiler"
    prepared.zero_grad()

    recompiles = _dynamo_graphs() - graphs_after_first
    if recompiles:
        prepared.notes.append(f"dynamo compiled {recompiles} more graph(s) after the first step")
    plan = prepared.plan()
    if plan is not None:
        keys = ("kept_bytes", "keep_all_bytes", "recompute_flops", "solve_seconds", "status", "budget_kind",
                "budget_bytes", "predicted_peak_bytes")
        for key in keys:
            value = getattr(plan, key, None)
            row[f"plan_{key}"] = value if isinstance(value, (int, float, str, type(None))) else str(value)
    row["notes"] = "; ".join(prepared.notes)
    return row, grads


def _resolve(strategy: Strategy, rows: list[Row], ref: _Reference) -> tuple[Strategy, str]:
    """Turn remat@match:NAME into remat@<bytes NAME saved inside the model>."""
    if not (isinstance(strategy.budget, str) and strategy.budget.startswith("match:")):
        return strategy, ""
    target = strategy.budget.split(":", 1)[1]
    for row in rows:
        if row["strategy"] == target and row.get("status") == "ok":
            if strategy.solver == "peak":
                # The measured activation peak of the whole step (the loss's temporaries included).
                return dataclasses.replace(strategy, budget=int(row["peak_act_bytes"])), target
            # Allocator-level bytes held for backward: remat plans the loss with the model.
            return dataclasses.replace(strategy, budget=max(int(row["held_bytes"]), 1), solver="saved"), target
    raise LookupError(f"no successful {target!r} row to match")


def run_model(
    spec: ModelSpec,
    strategies: list[Strategy],
    cfg: RunConfig,
    on_row: Callable[[Row], None] = lambda row: None,
) -> list[Row]:
    """Measure every strategy on ``spec``. "none" runs first: it is the reference for the rest."""
    work = build(spec, seed=cfg.seed, device=cfg.device, dtype=cfg.torch_dtype)
    options = Options(compile_backend=cfg.compile_backend, remat_costs=cfg.remat_costs,
                      remat_time_limit=cfg.remat_time_limit)
    ordered = _run_order(strategies)
    rows: list[Row] = []
    ref: _Reference | None = None
    for strategy in ordered:
        row: Row = {"model": spec.label, "model_kind": spec.kind, "strategy": strategy.label,
                    "family": strategy.family, "solver": strategy.solver, "budget": strategy.budget}
        if cfg.deadline is not None and time.monotonic() > cfg.deadline:
            row.update(status="skipped", error="time limit reached before this row started")
            rows.append(row)
            on_row(row)
            continue
        start = time.perf_counter()
        try:
            if ref is None and strategy.family != "none":
                raise RuntimeError("the none reference row failed")
            resolved, matched = _resolve(strategy, rows, ref) if ref else (strategy, "")
            if matched:
                row.update(matches=matched, budget=resolved.budget)
            prepared = prepare(resolved, work, options)
            measured, grads = _measure(prepared, work, cfg, ref)
            row.update(measured)
            row["status"] = "ok"
            if strategy.family == "none":
                row.update(_fp64_noise_floor(work, grads, cfg))
                hooked, held = _loss_saved_bytes(prepared.model, work, torch.device(cfg.device))
                ref = _Reference(grads, hooked, held)
                row["loss_saved_bytes"], row["loss_held_bytes"] = hooked, held
        except Exception as error:  # noqa: BLE001 - one failing row must not stop the sweep
            row.update(status="failed", error=_describe(error))
            log.warning("%s / %s failed:\n%s", spec.label, strategy.label, traceback.format_exc())
        finally:
            prepared = None  # type: ignore[assignment]
            _cleanup()
        row["wall_s"] = time.perf_counter() - start
        rows.append(row)
        on_row(row)
    _add_ratios(rows)
    if ref is not None:
        for row in rows:
            if row.get("status") == "ok":
                # remat rows plan the loss with the model; the others hold the loss's share beside it.
                loss_share = 0 if row["strategy"].startswith("remat") else ref.loss_held_bytes
                row["held_model_bytes"] = row["held_bytes"] - loss_share
                row["saved_model_bytes"] = row["saved_bytes"] - ref.loss_saved_bytes
    return rows


def _run_order(strategies: list[Strategy]) -> list[Strategy]:
    """"none" first (the reference), then the given order, each match row after its target."""
    ordered = [Strategy("none")] + [s for s in strategies if s.family != "none"]
    labels = [s.label for s in ordered]
    result: list[Strategy] = []
    waiting: dict[str, list[Strategy]] = {}
    for strategy in ordered:
        target = strategy.budget.split(":", 1)[1] if isinstance(strategy.budget, str) else None
        if target in labels and target not in {s.label for s in result}:
            waiting.setdefault(target, []).append(strategy)
            continue
        result.append(strategy)
        result.extend(waiting.pop(strategy.label, []))
    return result + [s for rows in waiting.values() for s in rows]


def _fp64_noise_floor(work: Workload, grads: list[torch.Tensor | None], cfg: RunConfig) -> Row:
    """How far eager fp32 gradients are from eager fp64 ones: the scale below which a strategy's
    gradient difference is rounding, not a bug. Skipped with dropout (fp64 draws other masks),
    off fp32 and on CUDA (fp64 is slow there and memory doubles)."""
    if cfg.dtype != "fp32" or cfg.device != "cpu":
        return {}
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in work.model.modules()):
        return {}
    model = copy.deepcopy(work.model).double()
    inputs = [x.double() if x.is_floating_point() else x for x in work.inputs]
    torch.manual_seed(cfg.seed + 1)
    work.loss_fn(model(*inputs), work.target).backward()
    diff = metrics.grad_difference(grads, [p.grad for p in model.parameters()])
    return {"grad_fp64_scaled": diff.scaled, "grad_fp64_rel_l2": diff.rel_l2}


def _cleanup() -> None:
    try:
        import torch._dynamo

        torch._dynamo.reset()
    except ImportError:
        pass
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # so one row's cached blocks do not inflate the next row's peak


def _describe(error: BaseException) -> str:
    """The outermost error type and the root cause's first line (wrappers say little)."""
    root, seen = error, {id(error)}
    while True:
        inner = getattr(root, "inner_exception", None) or root.__cause__
        if inner is None or id(inner) in seen:
            break
        root = inner
        seen.add(id(root))
    lines = [line for line in str(root).strip().splitlines() if line.strip()]
    text = f"{type(root).__name__}: {lines[0][:300] if lines else ''}"
    return text if root is error else f"{type(error).__name__} from {text}"


def _add_ratios(rows: list[Row]) -> None:
    base = next((r for r in rows if r["strategy"] == "none" and r.get("status") == "ok"), None)
    if base is None:
        return
    pairs = {
        "peak_ratio": "peak_bytes", "act_ratio": "peak_act_bytes", "held_ratio": "held_bytes",
        "saved_ratio": "saved_bytes",
        "flops_ratio": "flops", "time_ratio": "step_ms",
    }
    for row in rows:
        if row.get("status") != "ok":
            continue
        for ratio, key in pairs.items():
            row[ratio] = row[key] / base[key] if base.get(key) else None
        row["flop_overhead"] = row["flops_ratio"] - 1.0 if row["flops_ratio"] is not None else None


def measure_prepared(prepared: Prepared, work: Workload, cfg: RunConfig) -> tuple[Row, list[torch.Tensor | None]]:
    """One row's measurements and its gradients, without a reference (gradient differences are
    then 0): for benchmarks that compare against several references and time rows themselves
    (``vs_inductor``)."""
    return _measure(prepared, work, cfg, None)


def reset_between_rows() -> None:
    """What runs between two rows: ``torch._dynamo.reset()``, garbage collection, CUDA cache."""
    _cleanup()


def describe_error(error: BaseException) -> str:
    """A failed row's error: the outermost type and the root cause's first line."""
    return _describe(error)


def interleaved(steps: dict[str, Prepared], rounds: int, device: torch.device,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds per step of every row, taken in turn each round after one untimed round, so that
    drift on a shared machine hits every row of a round alike (``clock``: ``metrics.timed_once``'s)."""
    def step(prepared: Prepared) -> Callable[[], Any]:
        def run() -> torch.Tensor:
            prepared.zero_grad()
            return prepared.step()
        return run

    calls = {name: step(p) for name, p in steps.items()}
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(metrics.timed_once(call, device, clock)[1])
    return times
