"""``python -m benchmarks.cost_models`` end to end on tiny models: one row per cost model, the graphs
priced by each other's costs, and the markdown table written."""

from __future__ import annotations

import json

import torch

from benchmarks.cost_models import COSTS, KEEP_ALL, main


def test_cost_models_benchmark_smoke(tmp_path):
    threads = torch.get_num_threads()
    try:
        points = main(["--models", "gpt", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "16",
                       "--batch", "2", "--vocab", "64", "--budgets", "0.3", "--rounds", "2", "--warmup", "1",
                       "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    (point,) = points
    rows = {row["costs"]: row for row in point["rows"]}
    assert set(rows) == {*COSTS, KEEP_ALL}
    assert rows[KEEP_ALL]["recomputed_values"] == 0 and rows[KEEP_ALL]["predicted_measure_s"] == 0
    for costs in COSTS:
        row = rows[costs]
        assert row["recomputed_values"] > 0 and row["predicted_measure_s"] > 0 and row["predicted_roofline_s"] > 0
        assert len(row["step_s"]) == 2
    assert rows["measure"]["predicted_own_s"] == rows["measure"]["predicted_measure_s"]
    assert rows["roofline"]["predicted_own_s"] == rows["roofline"]["predicted_roofline_s"]
    saved = json.loads((tmp_path / "cost_models.json").read_text())
    assert len(saved["points"]) == 1
    assert "| gpt-l1-h32-s16-bs2 | 0.3 | measure |" in (tmp_path / "cost_models.md").read_text()
