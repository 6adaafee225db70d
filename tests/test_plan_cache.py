"""The plan cache on disk: a restarted job (a fresh process) skips the solve; a changed planning input misses."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import remat_pass
from remat_pass import plan_cache as plan_cache_module
from remat_pass.plan_cache import PlanCache

from .helpers import assert_same_step, eager_reference, run_step


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))


def _loss(output, *_inputs):
    return output.square().mean()


def _step(cache, budget=0.5):
    torch._dynamo.reset()  # a fresh compile, as a restarted job would make
    model, inputs = _model(), (torch.randn(4, 8),)
    compiled = torch.compile(model, backend=remat_pass.backend(budget, plan_cache=cache))
    return model, inputs, run_step(model, compiled, inputs, _loss), compiled


def test_same_graph_and_inputs_hit_and_a_changed_budget_misses(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=plan_cache_module.__name__)
    cache = PlanCache(tmp_path)
    _step(cache)
    assert cache.stats == {"hits": 0, "misses": 1} and len(list(tmp_path.glob("*.json"))) == 1
    model, inputs, cached, _ = _step(cache)
    assert cache.stats == {"hits": 1, "misses": 1}
    assert_same_step(cached, eager_reference(model, inputs, _loss))
    _step(cache, budget=0.3)
    assert cache.stats == {"hits": 1, "misses": 2} and len(list(tmp_path.glob("*.json"))) == 2
    messages = [r.getMessage() for r in caplog.records if r.name == plan_cache_module.__name__]
    assert sum("plan cache hit" in m for m in messages) == 1 and sum("plan cache miss" in m for m in messages) == 2


def test_a_fresh_process_with_the_same_cache_hits(tmp_path):
    _step(str(tmp_path))
    script = textwrap.dedent(f"""
        import json, torch
        from torch import nn
        import remat_pass
        from remat_pass.plan_cache import PlanCache
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))
        cache = PlanCache({str(tmp_path)!r})
        compiled = torch.compile(model, backend=remat_pass.backend(0.5, plan_cache=cache))
        compiled(torch.randn(4, 8)).square().mean().backward()
        print(json.dumps(cache.stats))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"hits": 1, "misses": 0}


def test_an_unreadable_file_is_a_miss_and_is_rewritten(tmp_path):
    cache = PlanCache(tmp_path)
    _step(cache)
    (path,) = tmp_path.glob("*.json")
    path.write_text("{not json")
    _step(cache)
    assert cache.stats == {"hits": 0, "misses": 2}
    assert json.loads(path.read_text())["format"] == plan_cache_module.FORMAT


def test_plan_cache_argument_is_checked():
    with pytest.raises(TypeError, match="plan_cache must be"):
        remat_pass.backend(0.5, plan_cache=42)


def test_optimize_takes_a_plan_cache(tmp_path):
    cache = PlanCache(tmp_path)
    for expected_stats in ({"hits": 0, "misses": 1}, {"hits": 1, "misses": 1}):
        torch._dynamo.reset()
        model, inputs = _model(), (torch.randn(4, 8),)
        optimized = remat_pass.optimize(model, budget=0.5, plan_cache=cache)
        assert_same_step(run_step(model, optimized, inputs, _loss), eager_reference(model, inputs, _loss))
        assert cache.stats == expected_stats
