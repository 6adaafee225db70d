"""The benchmark harness: its smoke preset end to end, and its measurements on hand-counted cases."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from benchmarks import metrics
from benchmarks.cli import main
from benchmarks.models import ModelSpec, build
from benchmarks.strategies import Strategy, remat_optimize
from remat_pass.solvers.mip import cpsat

CPU = torch.device("cpu")


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    threads = torch.get_num_threads()
    out = tmp_path_factory.mktemp("bench")
    try:
        rows = main(["--preset", "smoke", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    return out, {row["strategy"]: row for row in rows}


def test_smoke_writes_json_markdown_and_plot(smoke):
    out, rows = smoke
    payload = json.loads((out / "results.json").read_text())
    assert {row["strategy"] for row in payload["rows"]} == set(rows)
    table = (out / "results.md").read_text()
    assert "| none |" in table and "| checkpoint_blocks |" in table
    (png,) = out.glob("pareto_*.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_smoke_numbers_are_sane(smoke):
    _, rows = smoke
    none, ckpt = rows["none"], rows["checkpoint_blocks"]
    assert none["status"] == ckpt["status"] == "ok"
    assert 0 < ckpt["saved_bytes"] < none["saved_bytes"]
    assert 0 < ckpt["held_bytes"] < none["held_bytes"]
    assert 0 < ckpt["peak_act_bytes"] < none["peak_act_bytes"]
    # Checkpointing replays the RNG state, so dropout masks and gradients match eager.
    assert ckpt["grad_scaled_diff"] <= 1e-5
    assert ckpt["flop_overhead"] > 0 and none["flop_overhead"] == 0
    for row in (none, ckpt):
        # The two FLOP counters agree wherever both can see the work.
        assert row["flops_profiler"] == row["flops_dispatch"] == row["flops"]
        assert row["leftover_bytes"] <= 64  # the step frees everything but the gradients
        assert row["step_ms"] > 0


def test_smoke_has_a_remat_row_once_optimize_imports(smoke):
    out, rows = smoke
    optimize, why = remat_optimize()
    remat_rows = [row for name, row in rows.items() if name.startswith("remat")]
    if optimize is None:
        assert not remat_rows
        assert "not importable" in (out / "results.md").read_text()
        pytest.skip(f"remat_pass.optimize not importable: {why}")
    (row,) = remat_rows
    assert row["status"] == "ok", row.get("error")
    assert row["grad_scaled_diff"] <= 1e-5
    assert row["held_bytes"] < rows["none"]["held_bytes"]


@pytest.mark.parametrize("kind", ["gpt", "llama", "resnet"])
def test_profiler_flops_match_flop_counter_mode(kind):
    spec = ModelSpec(kind, layers=2, hidden=32, heads=2, seq=16, batch=2, vocab=64, dropout=0.0)
    work = build(spec)

    def step():
        work.loss_fn(work.model(*work.inputs), work.target).backward()

    counted = metrics.executed_flops(step)
    assert counted.uncounted == ()
    assert counted.total == metrics.dispatch_flops(step) > 0


def test_models_expose_blocks():
    for kind in ("gpt", "llama", "resnet"):
        work = build(ModelSpec(kind, layers=3, hidden=16, heads=2, seq=8, batch=2, vocab=32))
        assert len(work.model.blocks) == 3
        x = work.model(*work.inputs)
        assert torch.isfinite(x).all()


def test_strategy_names_parse():
    assert Strategy.parse("compile_budget@0.3") == Strategy("compile_budget", 0.3, "dp")
    assert Strategy.parse("compile_budget:greedy@0.3").label == "compile_budget:greedy@0.3"
    assert Strategy.parse("remat@1048576").budget == 1048576
    assert Strategy.parse("remat@match:sac").budget == "match:sac"
    assert Strategy.parse("remat:peak@match:sac") == Strategy("remat", "match:sac", "peak")
    for bad in ("remat", "sac@0.5", "compile_budget:cbc@0.5", "bogus", "remat@1.5", "remat:both@0.5"):
        with pytest.raises(ValueError):
            Strategy.parse(bad)


@pytest.mark.slow
def test_profiler_flops_see_compiled_recompute(tmp_path, restore_threads):
    rows = main([
        "--preset", "smoke", "--out", str(tmp_path), "--no-plots",
        "--strategies", "none,compile_mincut,compile_budget@0.0",
    ])
    by_name = {row["strategy"]: row for row in rows}
    assert by_name["compile_mincut"]["flops"] == by_name["none"]["flops"]
    # Budget 0 saves only the graph inputs: every forward matmul is recomputed in backward.
    assert by_name["compile_budget:dp@0.0"]["flops"] > by_name["none"]["flops"]
    assert by_name["compile_budget:dp@0.0"]["held_bytes"] < by_name["compile_mincut"]["held_bytes"]


def test_memory_timeline_plot(tmp_path):
    from benchmarks.models import ModelSpec
    from benchmarks.timeline import draw

    spec = ModelSpec("gpt", layers=1, hidden=32, heads=2, seq=16, batch=2, dropout=0.1, vocab=64)
    path = draw("gpt", 0.5, "saved", tmp_path, spec=spec)
    assert path.read_bytes().startswith(b"\x89PNG") and path.stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.skipif(not cpsat.available(), reason="OR-Tools is not installed")
def test_cpsat_workers_times_the_first_exact_round(caplog, restore_threads):
    from benchmarks.cpsat_workers import main as cpsat_workers

    workers = cpsat.WORKERS
    with caplog.at_level("INFO", logger="benchmarks.cpsat_workers"):
        assert cpsat_workers(["--model", "gpt", "--workers", "2", "--seconds", "5", "--no-highs"]) == 0
    assert cpsat.WORKERS == workers  # restored
    lines = [r.getMessage() for r in caplog.records if r.name == "benchmarks.cpsat_workers"]
    assert "first exact round" in lines[0] and lines[1].startswith("cpsat  workers 2")


def test_fit_probe_reports_inductors_estimate_of_each_compiled_graph(monkeypatch, caplog):
    """``benchmarks.fit_probe`` prints Inductor's peak estimate of every graph it compiles: a
    step of two matmuls and a tanh, forward and backward. Without the graph's outputs the
    forward's estimate leaves out what it saves for backward (the tanh, 8 x 4 floats, at least)."""
    import torch._inductor.memory as memory

    from benchmarks.fit_probe import report_inductor_estimates

    monkeypatch.setattr(memory, "reorder_for_peak_memory", memory.reorder_for_peak_memory)  # restored after
    report_inductor_estimates()
    weight = torch.randn(4, 4, requires_grad=True)
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False), \
            caplog.at_level(logging.INFO, logger="benchmarks.fit_probe"):
        torch._dynamo.reset()
        step = torch.compile(lambda x: (torch.tanh(x @ weight) @ weight).sum(), backend="inductor")
        step(torch.randn(8, 4)).backward()
    torch._dynamo.reset()
    lines = [record.getMessage() for record in caplog.records if "inductor estimate" in record.getMessage()]
    assert len(lines) == 2  # forward, backward
    (_, forward_peak, forward_internal), (_, backward_peak, backward_internal) = (
        [int(word) for word in line.replace(",", "").split() if word.isdigit()] for line in lines)
    assert 0 <= forward_internal <= forward_peak - 8 * 4 * 4
    assert 0 <= backward_internal <= backward_peak
