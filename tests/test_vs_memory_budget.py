"""benchmarks.vs_memory_budget: remat_pass at the measured peak of torch's activation_memory_budget points."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import vs_memory_budget as vs
from benchmarks.strategies import Strategy

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    threads = torch.get_num_threads()
    out = tmp_path_factory.mktemp("vs_budget")
    try:
        records = vs.main(["--model", "hf_gpt2", "--layers", "1", "--hidden", "16", "--heads", "2", "--seq", "8",
                           "--batch", "1", "--vocab", "32", "--points", "0.3", "--costs", "flops", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    rows = json.loads((out / "results.json").read_text())
    return out, records, {row["strategy"]: row for row in rows["rows"]}, rows["meta"]


def test_one_record_per_point_with_remat_at_its_measured_peak(toy):
    out, records, rows, meta = toy
    assert [r["point"] for r in records] == ["checkpoint_blocks", "compile_budget:dp@0.3"]
    assert "remat:peak:flops@match:compile_budget:dp@0.3" in meta["strategies"]
    for record in records:
        point = rows[record["point"]]
        remat = rows[f"remat:peak:flops@match:{record['point']}"]
        assert point["status"] == "ok" and record["point_grads_ok"]
        assert record["point_peak"] == point["peak_act_bytes"]
        if remat["status"] != "ok":
            assert "BudgetInfeasibleError" in remat["error"]
            continue
        assert remat["budget"] == point["peak_act_bytes"]  # the point's measured peak is remat's budget
        assert remat["plan_budget_kind"] == "peak"
        assert remat["peak_act_bytes"] <= point["peak_act_bytes"]
        assert remat["grad_scaled_diff"] == 0.0  # bit-exact: no dropout in the held-out models
        if point["flop_overhead"] > 0:
            assert record["ratio_flops"] == pytest.approx(remat["flop_overhead"] / point["flop_overhead"])
    assert json.loads((out / "comparison.json").read_text()) == records
    assert "| per-block checkpointing |" in (out / "comparison.md").read_text()


def test_hugging_face_checkpointing_is_the_per_block_point(toy):
    _, _, rows, _ = toy
    row = rows["checkpoint_blocks"]
    assert "activation_checkpointing_enable" in row["notes"]
    assert row["flop_overhead"] > 0 and row["grad_scaled_diff"] <= vs.GRAD_TOLERANCE
    assert row["saved_bytes"] < rows["none"]["saved_bytes"]


def test_a_remat_strategy_carries_its_cost_profile():
    strategy = Strategy.parse("remat:peak:flops@match:compile_budget:dp@0.1")
    assert (strategy.family, strategy.solver, strategy.costs) == ("remat", "peak", "flops")
    assert strategy.budget == "match:compile_budget:dp@0.1"
    assert Strategy.parse(strategy.label) == strategy
    assert Strategy.parse("remat::cpu@0.3") == Strategy("remat", 0.3, None, "cpu")
    with pytest.raises(ValueError, match="only remat takes a cost profile"):
        Strategy.parse("compile_budget:dp:flops@0.1")


def test_strategy_names_put_each_point_before_its_remat_rows():
    names = vs.strategy_names([0.1], ["flops", "auto"])
    assert names == ["none", "checkpoint_blocks", "compile_budget:dp@0.1",
                     "remat:peak:flops@match:checkpoint_blocks", "remat:peak:auto@match:checkpoint_blocks",
                     "remat:peak:flops@match:compile_budget:dp@0.1", "remat:peak:auto@match:compile_budget:dp@0.1"]


@pytest.mark.parametrize("point, remat, target, expected", [
    (vs.Side("ok", 100, 0.2, 0.0), vs.Side("ok", 90, 0.1, 0.0), 0.5, "met"),
    (vs.Side("ok", 100, 0.2, 0.0), vs.Side("ok", 90, 0.11, 0.0), 0.5, "missed"),
    (vs.Side("ok", 100, 0.2, 0.0), vs.Side("ok", 90, 0.2, 0.0), 1.0, "met"),
    (vs.Side("ok", 100, 0.2, 0.0), vs.Side("ok", 101, 0.0, 0.0), 1.0, "missed: over budget"),
    (vs.Side("ok", 100, 0.2, 0.0), vs.Side("ok", 90, 0.0, 1e-3), 1.0, "missed: gradients"),
    (vs.Side("ok", 100, 0.2, 0.0), vs.Side("failed"), 1.0, "missed: no plan"),
    (vs.Side("ok", 100, 0.0, 0.0), vs.Side("ok", 90, 0.0, 0.0), 0.5, "met"),
    (vs.Side("ok", 100, 0.0, 0.0), vs.Side("ok", 90, 0.01, 0.0), 0.5, "missed"),
    (vs.Side("ok", 100, 0.2, 0.1), vs.Side("ok", 90, 0.0, 0.0), 1.0, "n/a"),  # the point's gradients are wrong
])
def test_verdict(point, remat, target, expected):
    assert vs.verdict(remat, point, target) == expected


def test_mid_curve_points_ask_for_half_the_overhead():
    assert [vs.target_ratio(f"compile_budget:dp@{p}") for p in vs.POINTS] == [1.0, 1.0, 0.5, 0.5, 0.5, 1.0]
    assert vs.target_ratio("checkpoint_blocks") == 0.5
