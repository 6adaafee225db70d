"""Write results: ``results.json`` (everything), ``results.md`` (tables), ``pareto_<model>.png``."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Iterable

Row = dict[str, Any]

_COLUMNS = (
    "strategy", "peak act", "× none", "held after fwd", "× none", "saved (hooks)", "predicted / measured",
    "GFLOP", "× none", "step ms", "× none", "compile/plan s", "grad diff max / l2", "notes",
)


def _bytes(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "–"
    if abs(value) >= 2**20:
        return f"{value / 2**20:.2f} MiB"
    return f"{value / 2**10:.1f} KiB"


def _ratio(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, (int, float)) and math.isfinite(value) else "–"


def _num(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "–"


def _grad(row: Row) -> str:
    text = f"{row.get('grad_scaled_diff', 0):.1e} / {row.get('grad_rel_l2', 0):.1e}"
    return text if row.get("rng_matches_eager", True) else text + " †"


def markdown_table(rows: Iterable[Row]) -> str:
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    for row in rows:
        if row.get("status") != "ok":
            reason = row.get("error", row.get("status", ""))
            cells = [row["strategy"], f"**{row.get('status')}**: {reason}"] + [""] * (len(_COLUMNS) - 2)
        else:
            notes = row.get("notes", "")
            if row.get("matches"):
                what = "activation peak" if row.get("solver") == "peak" else "held bytes"
                notes = f"budget = {row['matches']}'s {what}; " + notes
            if row.get("cuda_peak_bytes") is not None:
                notes = (f"max_memory_allocated peak {_bytes(row['cuda_peak_bytes'])} (allocator history, "
                         f"gradients included: {_bytes(row['peak_bytes'])}); " + notes)
            if row.get("plan_predicted_peak_bytes") is not None:
                notes = f"predicted peak {_bytes(row['plan_predicted_peak_bytes'])}; " + notes
            if row.get("plan_status") is not None:
                kind = f"{row['plan_budget_kind']} budget, " if row.get("plan_budget_kind") else ""
                notes = (f"{kind}plan {row['plan_status']}, solve {_num(row.get('plan_solve_seconds'), '.2f')} s; "
                         + notes)
            predicted = "–"
            if row.get("plan_kept_bytes") is not None:
                predicted = f"{_bytes(row['plan_kept_bytes'])} / {_bytes(row.get('held_model_bytes'))}"
            cells = [
                row["strategy"], _bytes(row["peak_act_bytes"]), _ratio(row.get("act_ratio")),
                _bytes(row["held_bytes"]), _ratio(row.get("held_ratio")), _bytes(row["saved_bytes"]), predicted,
                _num(row["flops"] / 1e9, ".3f"), _ratio(row.get("flops_ratio")),
                _num(row["step_ms"], ".1f"), _ratio(row.get("time_ratio")),
                _num(row["compile_s"], ".2f"), _grad(row), notes.strip("; "),
            ]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def write_markdown(rows: list[Row], meta: dict, path: Path) -> None:
    parts = [
        "# remat_pass benchmark results", "",
        f"Command: `{meta.get('command', '')}`", "",
        f"torch {meta.get('torch')}, device {meta.get('device')} ({meta.get('device_name', '')}), "
        f"dtype {meta.get('dtype')}, {meta.get('threads')} threads, compile backend "
        f"{meta.get('compile_backend')}, remat cost model {meta.get('remat_costs', 'cpu')}, "
        f"{meta.get('repeats')} timed steps after {meta.get('warmup')} warm-up.",
        "",
        "**peak act**: allocator-level peak of live bytes during forward+backward, above what was "
        "live before the step, not counting the parameter gradients the step leaves behind. "
        "**held after fwd**: allocator-level bytes still allocated after the forward (what the "
        "autograd graph holds for backward, loss included). **saved (hooks)**: "
        "`remat_pass.runtime.measure.saved_activation_bytes` (+ the SAC cache). **predicted / measured**: the "
        "remat plan's `kept_bytes` / held after fwd (remat compiles the loss with the model, so its budget covers the whole step). **GFLOP**: matmul, conv and "
        "attention FLOPs executed in forward+backward, recompute included. **grad diff**: against "
        "eager `none` with the same seed; max |Δg| / max |g| and ‖Δg‖ / ‖g‖ over all parameters. "
        "† dropout masks differ from eager by design (compiled RNG), so the gradients do too. "
        "See benchmarks/README.md.",
        "",
    ]
    if meta.get("remat_unavailable"):
        parts += [f"remat rows not run: remat_pass.optimize is not importable ({meta['remat_unavailable']}).", ""]
    for model in dict.fromkeys(row["model"] for row in rows):
        model_rows = [r for r in rows if r["model"] == model]
        extra = ""
        loss_held = next((r.get("loss_held_bytes") for r in model_rows if r.get("loss_held_bytes")), None)
        grads = next((r.get("grad_bytes") for r in model_rows if r.get("grad_bytes")), None)
        if loss_held is not None:
            extra = f"\n\nThe loss holds {_bytes(loss_held)} of every row's held bytes; parameter gradients: {_bytes(grads)}."
            floor = next((r for r in model_rows if r.get("grad_fp64_rel_l2") is not None), None)
            if floor is not None:
                extra += (f" Gradient noise floor (eager fp32 vs fp64): max {floor['grad_fp64_scaled']:.1e}, "
                          f"l2 {floor['grad_fp64_rel_l2']:.1e}.")
        parts += [f"## {model}{extra}", "", markdown_table(model_rows), ""]
        if any(r.get("status") == "ok" for r in model_rows):
            parts += [f"![Pareto plot](pareto_{safe_name(model)}.png)", ""]
    path.write_text("\n".join(parts))


def write_json(rows: list[Row], meta: dict, path: Path) -> None:
    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        return value

    payload = {"meta": meta, "rows": [{k: clean(v) for k, v in row.items()} for row in rows]}
    path.write_text(json.dumps(payload, indent=1, default=str))


def _family_style(family: str) -> tuple[str, str]:
    return {
        "none": ("o", "black"), "checkpoint_blocks": ("s", "tab:blue"),
        "checkpoint_sequential": ("D", "tab:cyan"), "sac": ("^", "tab:green"),
        "compile_mincut": ("P", "tab:orange"), "compile_budget": ("x", "tab:red"),
        "remat": ("*", "tab:purple"),
    }.get(family, ("o", "gray"))


def pareto_plot(rows: list[Row], path: Path, title: str) -> None:
    """Two panels, peak activation memory and saved bytes, each against FLOP overhead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok" and r.get("flop_overhead") is not None]
    if not ok:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    for ax, key, name in ((axes[0], "peak_act_bytes", "peak activation memory"),
                          (axes[1], "held_bytes", "bytes held for backward after the forward")):
        lines: dict[str, list[Row]] = {}
        for row in ok:
            if row["family"] in ("remat", "compile_budget") and not row.get("matches"):
                lines.setdefault(row["strategy"].split("@")[0], []).append(row)
        for label, members in lines.items():
            members.sort(key=lambda r: (isinstance(r["budget"], int), r["budget"]))  # sweep order
            marker, color = _family_style(members[0]["family"])
            ax.plot([100 * r["flop_overhead"] for r in members], [r[key] / 2**20 for r in members],
                    "-", color=color, alpha=0.4, linewidth=1)
        seen: set[str] = set()
        for row in ok:
            marker, color = _family_style(row["family"])
            legend = row["family"] if row["family"] not in seen else None
            seen.add(row["family"])
            ax.scatter(100 * row["flop_overhead"], row[key] / 2**20, marker=marker, color=color,
                       s=60, label=legend, zorder=3)
            short = re.sub(r"^(compile_budget|remat)", lambda m: {"compile_budget": "cb", "remat": "r"}[m[1]],
                           row["strategy"])
            if row.get("matches"):
                short = f"r{'p' if row.get('solver') == 'peak' else ''}=~{row['matches']}"
            ax.annotate(short, (100 * row["flop_overhead"], row[key] / 2**20), fontsize=6,
                        xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("FLOP overhead vs none (%)")
        ax.set_ylabel(f"{name} (MiB)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def write_all(rows: list[Row], meta: dict, out_dir: Path, plots: bool = True) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "results.json", out_dir / "results.md"]
    write_json(rows, meta, written[0])
    write_markdown(rows, meta, written[1])
    if plots:
        for model in dict.fromkeys(row["model"] for row in rows):
            path = out_dir / f"pareto_{safe_name(model)}.png"
            pareto_plot([r for r in rows if r["model"] == model], path, model)
            if path.exists():
                written.append(path)
    return written
