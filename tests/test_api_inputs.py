"""Keyword inputs wherever inputs are accepted; plan-ahead and the first training call share one plan."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat_pass
from remat_pass.capture.inputs import CallInputs, call_inputs, canonical, forward_signature

from .helpers import assert_same_step, run_step


class KeywordModel(nn.Module):
    """Called like a Hugging Face model: ``model(**batch)`` with optional mask and labels."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.1)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.drop(torch.tanh(self.embed(input_ids)))
        h = self.norm(h.flatten(0, 1)).view_as(h)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        logits = self.head(h)
        if labels is None:
            return logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 16, (2, 6), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones(2, 6), "labels": ids.roll(1, dims=1)}


def _loss(output, *_inputs):
    return output


def _keyword_step(model, call, batch, seed=1234):
    """run_step for a model called with keywords (the batch's tensors are inputs, not activations)."""
    return run_step(model, lambda *values: call(**dict(zip(batch, values))), tuple(batch.values()), _loss, seed)


def test_dict_example_inputs_are_keywords_and_the_first_call_reuses_the_plan():
    model, batch = KeywordModel(), _batch()
    reference = copy.deepcopy(model)
    expected = _keyword_step(reference, reference, batch)
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    optimized = remat_pass.optimize(model, budget=0.5, example_inputs=batch)
    assert optimized.plan is not None and len(optimized._backend.plans) == 1
    assert torch.equal(torch.get_rng_state(), rng)  # planning ahead leaves RNG and buffers alone
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    actual = _keyword_step(model, optimized, batch)
    assert len(optimized._backend.plans) == 1, "the training call captured again"
    assert_same_step(actual, expected)
    assert actual.saved_bytes == optimized.plan.kept_bytes


@pytest.mark.parametrize("ahead", ["positional", "mixed", "plan_ahead_kwargs"])
def test_plan_made_one_way_serves_calls_made_the_other_way(ahead):
    model, batch = KeywordModel(), _batch()
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    if ahead == "positional":
        optimized = remat_pass.optimize(model, budget=0.5, example_inputs=(ids, mask, labels))
    elif ahead == "mixed":
        optimized = remat_pass.optimize(model, budget=0.5, example_inputs=(ids,),
                                        example_kwargs={"attention_mask": mask, "labels": labels})
    else:
        optimized = remat_pass.optimize(model, budget=0.5)
        assert optimized.plan_ahead(**batch) is optimized.plan is not None
    planned = optimized.plan
    optimized(**batch).backward()  # the keyword call training makes
    optimized(ids, attention_mask=mask, labels=labels).backward()
    optimized(ids, mask, labels).backward()
    assert len(optimized._backend.plans) == 1 and len(optimized.plans) == 1
    assert optimized.plan is planned


def test_a_different_set_of_keywords_is_a_different_plan():
    model, batch = KeywordModel(), _batch()
    optimized = remat_pass.optimize(model, budget=0.5, example_inputs=batch)
    optimized(input_ids=batch["input_ids"]).sum().backward()  # no mask, no labels: another graph
    assert len(optimized.plans) == 2 and len(optimized._backend.plans) == 2


class TakesADict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, batch):
        return self.fc(batch["x"]).tanh().sum()


def test_a_dict_as_the_one_positional_input_is_spelled_as_a_tuple():
    model = TakesADict()
    batch = {"x": torch.randn(3, 4)}
    optimized = remat_pass.optimize(model, budget=1.0, example_inputs=(batch,))
    optimized(batch).backward()
    assert len(optimized._backend.plans) == 1


@pytest.mark.parametrize("example_inputs, example_kwargs, expected", [
    (None, None, CallInputs()),
    (1, None, CallInputs((1,))),
    ((1, 2), None, CallInputs((1, 2))),
    ([1, 2], {"a": 3}, CallInputs((1, 2), {"a": 3})),
    ({"a": 1}, None, CallInputs((), {"a": 1})),
    ({"a": 1}, {"b": 2}, CallInputs((), {"a": 1, "b": 2})),
    (None, {"b": 2}, CallInputs((), {"b": 2})),
])
def test_call_inputs_normalizes_every_spelling(example_inputs, example_kwargs, expected):
    assert call_inputs(example_inputs, example_kwargs) == expected


@pytest.mark.parametrize("example_inputs, example_kwargs, message", [
    ({0: torch.ones(1)}, None, r"example_inputs=\(batch,\)"),
    ({"a": 1}, {"a": 2}, "given twice"),
    ((1,), [("a", 1)], "mapping"),
])
def test_ambiguous_or_malformed_inputs_are_type_errors(example_inputs, example_kwargs, message):
    with pytest.raises(TypeError, match=message):
        call_inputs(example_inputs, example_kwargs)


def test_canonical_form_is_the_same_for_every_split():
    def forward(input_ids, attention_mask=None, labels=None, **extra):
        raise AssertionError("not called")

    signature = forward_signature(forward)
    forms = [
        canonical(signature, (1,), {"labels": 3}),
        canonical(signature, (), {"input_ids": 1, "labels": 3}),
    ]
    assert forms[0] == forms[1] == ((1,), {"labels": 3})
    assert canonical(signature, (1, 2, 3), {}) == canonical(signature, (), {"labels": 3, "attention_mask": 2,
                                                                              "input_ids": 1})
    assert canonical(signature, (), {"nope": 1}) == ((), {"nope": 1})  # extra keywords go to **extra
    assert canonical(signature, (1, 2, 3, 4), {}) == ((1, 2, 3, 4), {})  # does not bind: as given


def test_wrong_keyword_is_the_model_s_own_error():
    optimized = remat_pass.optimize(TakesADict(), budget=1.0)
    with pytest.raises(Exception, match="unexpected keyword|got an unexpected|not in"):
        optimized(batch={"x": torch.randn(3, 4)}, extra=1)


# --- remat_pass.plan with keyword inputs --------------------------------------------------------------


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       bos_token_id=0, eos_token_id=1, pad_token_id=None)


def test_plan_a_batch_dict_on_the_meta_device_and_the_mixed_form_agrees():
    with torch.device("meta"):
        model = KeywordModel()
        ids = torch.zeros(2, 6, dtype=torch.long)
        batch = {"input_ids": ids, "attention_mask": torch.ones(2, 6), "labels": ids}
    planned = remat_pass.plan(model, batch, budget=0.5, device="cpu", solver="ilp")
    assert 0 < planned.kept_bytes <= 0.5 * planned.keep_all_bytes
    assert next(model.parameters()).device.type == "meta"  # nothing was materialized
    mixed = remat_pass.plan(model, (ids,), budget=0.5, device="cpu", solver="ilp",
                            example_kwargs={"attention_mask": batch["attention_mask"], "labels": ids})
    assert (mixed.keep_all_bytes, mixed.kept_bytes) == (planned.keep_all_bytes, planned.kept_bytes)


@pytest.mark.slow
def test_plan_a_hugging_face_batch_dict_on_the_meta_device():
    """The issue's case: ``plan(model, batch_dict)`` failed inside ``embedding()`` (the dict was
    one positional input)."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(_llama_config())
        ids = torch.zeros(2, 12, dtype=torch.long)
        batch = {"input_ids": ids, "attention_mask": torch.ones(2, 12, dtype=torch.long), "labels": ids}
    planned = remat_pass.plan(model, batch, budget=0.5)
    assert 0 < planned.kept_bytes <= 0.5 * planned.keep_all_bytes
    assert next(model.parameters()).device.type == "meta"


def test_plan_with_keywords_predicts_what_optimize_keeps():
    model, batch = KeywordModel(), _batch()
    planned = remat_pass.plan(model, batch, budget=1.0, device="cpu", solver="ilp")
    optimized = remat_pass.optimize(model, budget=1.0, example_inputs=batch)
    assert planned.keep_all_bytes == optimized.plan.keep_all_bytes


def test_explain_and_sweep_take_a_batch_dict_too():
    from remat_pass.tools.explain import explain

    model, batch = KeywordModel(), _batch()
    report = explain(model, batch, budget=0.5)
    assert report.plan.kept_bytes <= 0.5 * report.plan.keep_all_bytes
    curve = remat_pass.sweep(model, batch, budgets=(1.0, 0.5), baselines=())
    assert [point.budget for point in curve.points] == [0.5, 1.0]
    assert curve.points[-1].kept_bytes == report.plan.keep_all_bytes


def test_cli_factory_may_return_a_batch_dict(capsys, monkeypatch):
    import json
    from pathlib import Path

    from remat_pass.tools.cli import main

    monkeypatch.chdir(Path(__file__).parents[1])
    assert main(["explain", "tests/explain_factory.py:factory_keywords", "--budget", "0.5", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert 0 < data["kept_bytes"] <= 0.5 * data["keep_all_bytes"]
