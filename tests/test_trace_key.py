"""The pre-trace plan cache key (planning.trace_key): a repeated plan()/explain() skips the trace and
returns the same plan; anything the trace could depend on misses."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import remat_pass
from remat_pass.capture.inputs import call_inputs
from remat_pass.examples import GPT, GPTConfig
from remat_pass.planning import plan_model, trace_key as trace_key_module
from remat_pass.planning.trace_key import trace_key
from remat_pass.runtime.plan_cache import PlanCache
from remat_pass.tools import explain as explain_module


def _gpt(dropout: float = 0.1, layers: int = 2) -> nn.Module:
    with torch.device("meta"):
        return GPT(GPTConfig(layers=layers, hidden=64, heads=2, seq_len=32, vocab_size=128, dropout=dropout))


def _tokens(seq: int = 32) -> torch.Tensor:
    return torch.zeros(2, seq, dtype=torch.long, device="meta")


@pytest.fixture
def traces(monkeypatch):
    """How many times plan() and explain() traced a step."""
    calls = []
    for module in (plan_model, explain_module):
        original = module.trace_repeated

        def counting(*args, _original=original, **kwargs):
            calls.append(1)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, "trace_repeated", counting)
    return calls


def test_a_repeated_plan_is_not_traced_and_is_the_plan_the_traced_path_returns(tmp_path, traces):
    model, cache = _gpt(), PlanCache(tmp_path)
    first = remat_pass.plan(model, (_tokens(),), budget=0.5, plan_cache=cache)
    assert len(traces) == 1 and cache.stats == {"hits": 0, "misses": 1}
    again = remat_pass.plan(model, (_tokens(),), budget=0.5, plan_cache=cache)
    assert len(traces) == 1, "the second call traced"
    assert cache.stats == {"hits": 1, "misses": 1}
    traced = remat_pass.plan(model, (_tokens(),), budget=0.5, plan_cache=cache, pretrace_key=False)
    assert len(traces) == 2 and cache.stats == {"hits": 2, "misses": 1}  # the Problem-keyed hit
    assert again == first == traced and again.problem == traced.problem
    assert again.recomputed and again.kept_bytes <= 0.5 * again.keep_all_bytes


def test_a_changed_dropout_p_is_traced_again_and_planned_anew(tmp_path, traces):
    cache = PlanCache(tmp_path)
    remat_pass.plan(_gpt(0.1), (_tokens(),), budget=0.5, plan_cache=cache)
    other = remat_pass.plan(_gpt(0.0), (_tokens(),), budget=0.5, plan_cache=cache)
    assert len(traces) == 2 and cache.stats == {"hits": 0, "misses": 2}
    assert not any("dropout" in value.op for value in other.problem.values)


def test_explain_is_answered_before_tracing_too(tmp_path, traces):
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    inputs = (torch.randn(4, 8),)
    first = explain_module.explain(model, inputs, budget=0.5, plan_cache=tmp_path)
    again = explain_module.explain(model, inputs, budget=0.5, plan_cache=tmp_path)
    assert len(traces) == 1 and again.plan == first.plan and again.rows == first.rows
    explain_module.explain(model, inputs, budget=0.5, plan_cache=tmp_path, depth=1)
    explain_module.explain(model, (torch.randn(4, 8),), budget=0.5, plan_cache=tmp_path)  # new token values
    assert len(traces) == 3


class _Block(nn.Module):
    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.p = p
        self.scale = 2.0

    def forward(self, x):
        return F.dropout(torch.tanh(self.fc(x)) * self.scale, self.p, self.training)


def _key(model: nn.Module, *inputs, **arguments) -> str:
    return trace_key("plan", model, call_inputs(inputs), {"budget": 0.5, **arguments})


def _other_forward(self, x):
    return torch.sigmoid(self.fc(x))


@pytest.mark.parametrize("change", ["forward", "attribute", "shape", "dropout_p", "eval", "frozen",
                                    "hook", "grad_mode", "budget", "loss_fn", "token_values"])
def test_what_the_trace_depends_on_changes_the_key(change, monkeypatch):
    torch.manual_seed(0)
    model, x = _Block(), torch.randn(4, 8)
    before = _key(model, x, loss_fn=None)
    assert _key(model, x, loss_fn=None) == before, "the key is not stable"
    arguments = {"loss_fn": None}
    if change == "forward":
        monkeypatch.setattr(_Block, "forward", _other_forward)
    elif change == "attribute":
        model.scale = 3.0
    elif change == "shape":
        x = torch.randn(4, 8)[:2]
    elif change == "dropout_p":
        model.p = 0.2
    elif change == "eval":
        model.eval()
    elif change == "frozen":
        model.fc.bias.requires_grad_(False)
    elif change == "hook":
        model.register_forward_hook(lambda module, args, output: output * 2)
    elif change == "grad_mode":
        with torch.no_grad():
            assert _key(model, x, **arguments) != before
        return
    elif change == "budget":
        assert _key(model, x, loss_fn=None, budget=0.4) != before
        return
    elif change == "loss_fn":
        arguments = {"loss_fn": lambda output, *_: output.sum()}
    elif change == "token_values":
        x = x + 1
    assert _key(model, x, **arguments) != before


def test_tied_weights_change_the_key():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), torch.randn(4, 8)
    before = _key(model, x)
    model[1].weight = model[0].weight  # the same shapes; one parameter fewer in the graph
    assert _key(model, x) != before


def test_an_edited_source_file_changes_the_key(tmp_path, monkeypatch):
    """A helper beside the forward, in the same file, is seen through the file's digest."""
    source = tmp_path / "edited_model.py"
    text = textwrap.dedent("""
        import torch
        def helper(x):
            return torch.tanh(x)
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(4, 4)
            def forward(self, x):
                return helper(self.fc(x))
    """)
    source.write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    import edited_model

    model, x = edited_model.Net(), torch.randn(2, 4)
    before = _key(model, x)
    source.write_text(text.replace("tanh", "relu"))
    os.utime(source, ns=(os.stat(source).st_atime_ns, os.stat(source).st_mtime_ns + 10**9))
    assert _key(model, x) != before


def test_measured_costs_have_no_pre_trace_key():
    assert trace_key("plan", _Block(), call_inputs((torch.randn(4, 8),)), {"costs": "measure"}) is None


def test_the_key_is_the_same_in_a_process_with_another_hash_seed():
    """Sets and Python's string hashes vary by process (a Hugging Face config caches one; torch's
    config hashes pickle sets): a key that followed them would never hit in a new process."""
    program = textwrap.dedent("""
        import torch, transformers
        from remat_pass.capture.inputs import call_inputs
        from remat_pass.planning.trace_key import trace_key
        config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
        with torch.device("meta"):
            model = transformers.GPT2LMHeadModel(config)
        print(trace_key("plan", model, call_inputs({"input_ids": torch.zeros(1, 16, dtype=torch.long, device="meta")}),
                        {"budget": 0.5}))
    """)
    keys = {subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip().splitlines()[-1]
            for seed in ("1", "2")}
    assert len(keys) == 1


def test_a_crafted_cache_file_cannot_run_code(tmp_path):
    cache = PlanCache(tmp_path)
    cache.traced_directory.mkdir(parents=True)

    class Payload:
        def __reduce__(self):
            return os.system, ("touch " + str(tmp_path / "ran"),)

    (cache.traced_directory / "k.pickle").write_bytes(pickle.dumps(Payload()))
    assert cache.get_traced("k") is None and not (tmp_path / "ran").exists()
    assert trace_key_module.before_tracing("plan", _Block(), call_inputs(()), {}, None, lambda: 7) == 7


def test_an_attribute_that_cannot_be_described_means_no_key_not_a_failure():
    class Opaque:
        __slots__ = ()

        def __repr__(self):
            raise RuntimeError("no repr")

    model = _Block()
    model.opaque = Opaque()
    assert trace_key("plan", model, call_inputs((torch.randn(4, 8),)), {}) is None


def test_a_changed_hugging_face_config_attribute_changes_the_key():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    before = trace_key("plan", model, call_inputs({"input_ids": ids}), {})
    assert trace_key("plan", model, call_inputs({"input_ids": ids}), {}) == before
    # Read at each call (which attention function runs), through the config each module holds.
    model.config._attn_implementation = "eager" if model.config._attn_implementation != "eager" else "sdpa"
    assert trace_key("plan", model, call_inputs({"input_ids": ids}), {}) != before
