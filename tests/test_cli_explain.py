"""``remat-pass explain`` end to end: the real process once for --json/--plot (numbers checked against
the Python API) and once for a bad argument (exit status 2); the rest in-process through ``main(argv)``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from remat_pass.tools.cli import main
from remat_pass.tools.explain import explain_traced
from remat_pass.planning.pipeline import trace_step

from .explain_factory import factory

ROOT = Path(__file__).resolve().parents[1]
FACTORY = "tests/explain_factory.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "remat_pass.tools.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_json_and_plot_subprocess_match_the_python_api(tmp_path):
    result = run_cli("explain", f"{FACTORY}:factory", "--budget", "0.5", "--json", "--plot", str(tmp_path))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)  # stdout is the JSON alone: solver banners go to stderr
    expected = explain_traced(trace_step(*factory()), 0.5).to_dict()
    for key in ("solver", "status", "budget_bytes", "kept_bytes", "keep_all_bytes", "recompute_flops",
                "step_flops", "budget"):
        assert data[key] == expected[key], key
    assert (data["budget_bytes"], data["keep_all_bytes"]) == (384, 768)
    assert data["recompute_seconds"] == pytest.approx(expected["recompute_seconds"])
    assert [e["name"] for e in data["kept"]] == [e["name"] for e in expected["kept"]]
    strip = lambda rows: [{k: v for k, v in r.items() if k != "recompute_seconds"} for r in rows]  # noqa: E731
    assert strip(data["per_module"]) == strip(expected["per_module"])
    assert sum(r["kept_bytes"] for r in data["per_module"]) == data["kept_bytes"]
    assert [Path(p) for p in data["plots"]] == [tmp_path / "pareto.png", tmp_path / "memory_timeline.png"]
    for png in data["plots"]:
        content = Path(png).read_bytes()
        assert content.startswith(PNG_SIGNATURE) and len(content) > 1000


def test_bad_argument_subprocess_exits_2():
    result = run_cli("explain", f"{FACTORY}:no_such_factory", "--budget", "0.5")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines()[-1] == (
        f"remat-pass explain: error: {FACTORY} has no function 'no_such_factory'")


@pytest.mark.parametrize(("args", "message"), [
    (["missing.py:factory"], "no such file: missing.py"),
    ([FACTORY], "expected FILE.py:FACTORY"),
    ([f"{FACTORY}:not_a_model"], "its model is a str, not an nn.Module"),
    ([f"{FACTORY}:wrong_arity"], "got tuple of length 1"),
    ([f"{FACTORY}:factory", "--budget", "abc"], "invalid budget 'abc'"),
    ([f"{FACTORY}:factory", "--budget", "1.5"], "must lie in (0, 1]"),
    ([f"{FACTORY}:factory", "--solver", "magic"], "unknown solver 'magic'"),
    ([f"{FACTORY}:factory", "--device", "tpu"], "unknown device profile 'tpu'"),
    ([f"{FACTORY}:factory", "--costs", "timed"], "costs must be one of 'roofline', 'flops', 'measure'"),
    ([f"{FACTORY}:factory", "--depth", "0"], "must be a positive integer"),
])
def test_bad_input_exits_2_with_one_line(args, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as info:
        main(["explain", *args])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith("remat-pass explain: error: ") and message in last


def test_table_output(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["explain", f"{FACTORY}:factory_with_loss", "--budget", "0.3", "--depth", "2"]) == 0
    out = capsys.readouterr().out
    assert "Plan by ilp" in out and "blocks.0" in out and "blocks.1" in out and "total" in out
    assert "full" in out or "selective" in out


@pytest.mark.parametrize("choice,said", [("on", "computed with the loss in forward"),
                                         ("recomputed", "backward recomputes the head"), ("off", None)])
def test_chunk_loss_reaches_the_planner(choice, said, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["explain", f"{FACTORY}:factory_language_model", "--budget", "0.5", "--chunk-loss", choice,
                 "--plan-cache", "off"]) == 0
    out = capsys.readouterr().out
    assert ("loss chunked: 64 tokens x 512 vocabulary" in out) is (said is not None)
    assert said is None or said in out


def test_measured_costs(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["explain", f"{FACTORY}:factory_with_loss", "--budget", "0.3", "--costs", "measure"]) == 0
    assert "Plan by ilp" in capsys.readouterr().out


def test_infeasible_budget_exits_1_and_names_the_smallest(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["explain", f"{FACTORY}:factory_dropout", "--budget", "32B", "--budget-kind", "saved"]) == 1
    err = capsys.readouterr().err
    assert "smallest feasible budget for this graph is 64 bytes" in err
    assert main(["explain", f"{FACTORY}:factory_dropout", "--budget", "32B", "--budget-kind", "saved", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["error"] == "infeasible" and data["min_feasible_bytes"] == 64


def test_memory_timeline_is_drawn_from_the_simulator(tmp_path, capsys, monkeypatch):
    from remat_pass.tools import report

    seen = []
    simulated = report.memory_timeline

    def timeline(plan):
        seen.append(plan)
        series = simulated(plan)
        assert len(series) == 2 and all(points for points in series.values())
        keep_all, planned = series.values()
        assert keep_all[-1][0] > 0 and planned[-1][0] > 0  # forward and backward events, both series
        return series

    monkeypatch.setattr(report, "memory_timeline", timeline)
    monkeypatch.chdir(ROOT)
    assert main(["explain", f"{FACTORY}:factory_dropout", "--budget", "0.5", "--plot", str(tmp_path)]) == 0
    assert len(seen) == 1 and seen[0].budget_bytes == 160
    assert (tmp_path / "memory_timeline.png").read_bytes().startswith(PNG_SIGNATURE)
    assert f"wrote {tmp_path / 'pareto.png'}" in capsys.readouterr().out


def test_solver_help_lists_the_registry(capsys):
    from remat_pass import solvers

    with pytest.raises(SystemExit):
        main(["explain", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for name, info in solvers.SOLVER_INFO.items():
        assert f"{name}: {' '.join(info.description.split())}" in out


def test_prove_and_plan_cache_reach_the_planner(capsys, monkeypatch, tmp_path):
    """``--prove`` asks for the proof work (60 s), ``--time-limit`` alone too, neither for none;
    ``--plan-cache DIR`` stores the plan there, ``--plan-cache off`` stores nothing."""
    import remat_pass.tools.explain as explain_module

    monkeypatch.chdir(ROOT)
    seen = []
    explain_traced = explain_module.explain_traced

    def recording(*args, **options):
        seen.append({k: options.get(k) for k in ("time_limit", "prove", "plan_cache")})
        return explain_traced(*args, **options)

    monkeypatch.setattr(explain_module, "explain_traced", recording)
    target = f"{FACTORY}:factory_with_loss"
    assert main(["explain", target, "--budget", "0.3", "--prove", "--plan-cache", str(tmp_path)]) == 0
    assert main(["explain", target, "--budget", "0.3", "--time-limit", "7", "--plan-cache", "off"]) == 0
    assert seen == [{"time_limit": None, "prove": True, "plan_cache": str(tmp_path)},
                    {"time_limit": 7.0, "prove": None, "plan_cache": False}]
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_a_repeated_command_is_answered_before_tracing(capsys, monkeypatch, tmp_path):
    """The same ``explain`` command against the same ``--plan-cache`` does not trace again
    (``planning.trace_key``) and prints the same numbers; ``--plot`` still traces (its curve needs the step)."""
    import remat_pass.tools.explain as explain_module

    monkeypatch.chdir(ROOT)
    traces = []
    original = explain_module.trace_repeated

    def counting(*args, **kwargs):
        traces.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(explain_module, "trace_repeated", counting)
    command = ["explain", f"{FACTORY}:factory_with_loss", "--budget", "0.3", "--json", "--plan-cache", str(tmp_path)]
    outputs = []
    for _ in range(2):
        assert main(command) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert len(traces) == 1 and outputs[0] == outputs[1] and outputs[0]["pieces"] == 1
    assert main([*command, "--plot", str(tmp_path / "plots")]) == 0
    assert len(traces) == 2
