"""``remat-pass estimate`` end to end: the real process once for JSON and once for a bad argument
(exit status 2), the rest in-process through ``main(argv)`` to keep the suite fast."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from remat_pass.tools.cli import main
from remat_pass.tools.estimate import (
    Policy,
    Workload,
    layer_activation_bytes,
    other_activation_bytes,
    parse_bytes,
    state_bytes,
    step_flops,
)

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ["--layers", "80", "--hidden", "8192", "--heads", "64", "--seq", "8192", "--batch", "1"]
SHARDED = ["--tp", "8", "--sequence-parallel", "--dp", "8", "--zero", "1", "--vocab", "32000"]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "remat_pass.tools.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_json_subprocess_matches_formulas() -> None:
    result = run_cli("estimate", *SHAPE, *SHARDED, "--gpu-memory", "80GB", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    w = Workload(layers=80, hidden=8192, heads=64, seq=8192, vocab=32000, tp=8, sequence_parallel=True,
                 dp=8, zero=1)
    assert data["workload"]["tp"] == 8 and data["hardware"]["memory_bytes"] == parse_bytes("80GB")
    rows = {row["policy"]: row for row in data["rows"]}
    for policy in Policy:
        assert rows[policy.value]["stored_bytes"] == layer_activation_bytes(w, policy)
    assert sum(data["counts"].values()) == 80
    weights, grads, optimizer = state_bytes(w)
    memory = data["memory"]
    assert (memory["weights"], memory["grads"], memory["optimizer"]) == (weights, grads, optimizer)
    assert memory["other_activations"] == other_activation_bytes(w)
    assert memory["layer_activations"] == sum(data["counts"][p] * rows[p]["stored_bytes"] for p in rows)
    assert memory["total"] <= memory["budget"]
    assert data["step_seconds"] == pytest.approx(step_flops(w) / 400e12)


def test_bad_argument_subprocess_exits_2() -> None:
    result = run_cli("estimate", *SHAPE, "--hidden", "8190", "--gpu-memory", "80GB")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip().splitlines()[-1] == (
        "remat-pass estimate: error: --hidden 8190 is not divisible by --heads 64")


@pytest.mark.parametrize("extra", [
    ["--gpu-memory", "80XB"],
    ["--gpu-memory", "80GB", "--layers", "-3"],
    ["--gpu-memory", "80GB", "--tp", "3"],
    ["--gpu-memory", "80GB", "--pcie-gbps", "-1"],
    ["--gpu-memory", "80GB", "--dtype", "fp8"],
    [],  # --gpu-memory is required
])
def test_bad_arguments_exit_2(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["estimate", *SHAPE, *extra])
    assert info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("remat-pass estimate: error: ")


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["estimate", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--layers", "--gpu-memory", "--sequence-parallel", "--flash-attention", "--pcie-gbps", "--json"):
        assert flag in out
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0 and "estimate" in capsys.readouterr().out


def test_command_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


def test_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", *SHAPE, "--gpu-memory", "80GB"]) == 1
    err = capsys.readouterr().err
    assert "does not fit" in err and "--dp --zero" in err
    assert main(["estimate", *SHAPE, "--gpu-memory", "80GB", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["error"] == "does_not_fit" and data["needed_bytes"] > data["budget_bytes"]


def test_rich_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", *SHAPE, *SHARDED, "--gpu-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    for text in ("Per-layer policy", "selective", "offload", "optimizer state", "headroom", "% of step"):
        assert text in out


def test_modules_do_not_import_torch() -> None:
    """estimate.py and cli.py load without torch (by path, so the package __init__ is not involved)."""
    code = (
        "import importlib.util, sys\n"
        "for name in ('estimate', 'cli'):\n"
        f"    spec = importlib.util.spec_from_file_location(name, {str(ROOT / 'remat_pass' / 'tools')!r} + f'/{{name}}.py')\n"
        "    module = importlib.util.module_from_spec(spec); sys.modules[name] = module\n"
        "    spec.loader.exec_module(module)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_pipeline_options(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", *SHAPE, *SHARDED, "--gpu-memory", "80GB", "--pp", "4", "--microbatches", "8", "--json"]
    assert main([*args, "--schedule", "interleaved"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["workload"]["pp"], data["workload"]["schedule"], data["workload"]["virtual_stages"]) == (
        4, "interleaved", 2)
    assert sum(data["counts"].values()) == 20  # the first stage's 80 / 4 layers
    assert main(args[:-1]) == 0
    assert "PP 4 (1f1b, 8 micro-batches; first stage: 20 layers, 4 micro-batches in flight)" in " ".join(
        capsys.readouterr().out.split())
