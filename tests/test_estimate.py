"""The analytic planner: Korthikanti et al. 2022 formulas, state bytes, FLOPs, policy search.

Published figures come from Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (arXiv:2205.05198): Table 2 (per-layer activation formulas), Table 3 (the
22B / 175B / 530B / 1T configurations, s = 2048, V = 51200), Appendix A (model FLOPs), and
section 5's "5as/h = 80 for GPT-3 / 64 for MT-NLG; selective recompute saves 70% / 65% of
activation memory for 2.7% / 1.6% FLOPs overhead".
"""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction

import pytest

from remat_pass.tools.layer_policies import activation_peak, search_counts
from remat_pass.tools.estimate import (
    Hardware,
    DoesNotFitError,
    LayerPlan,
    Policy,
    PolicyRow,
    Workload,
    attention_core_flops,
    layer_activation_bytes,
    layer_forward_flops,
    other_activation_bytes,
    parameter_count,
    parse_bytes,
    plan_layers,
    stage_parameter_count,
    state_bytes,
    step_flops,
)

NONE, SEL, FULL, OFF = Policy.NONE, Policy.SELECTIVE, Policy.FULL, Policy.OFFLOAD

# Korthikanti et al. 2022, Table 3: name -> (heads, hidden, layers, tp, micro-batch).
PAPER_MODELS = {
    "22B": (64, 6144, 48, 8, 4),
    "175B": (96, 12288, 96, 8, 1),
    "530B": (128, 20480, 105, 8, 1),
    "1T": (160, 25600, 128, 8, 1),
}
PAPER_SEQ, PAPER_VOCAB = 2048, 51200


def paper_workload(name: str, **overrides) -> Workload:
    heads, hidden, layers, tp, batch = PAPER_MODELS[name]
    kwargs = dict(layers=layers, hidden=hidden, heads=heads, seq=PAPER_SEQ, batch=batch,
                  vocab=PAPER_VOCAB, tp=tp, sequence_parallel=True)
    return Workload(**{**kwargs, **overrides})


# -- activation formulas ---------------------------------------------------------------


def test_small_integer_shape_exact() -> None:
    # s=2, b=1, h=4, a=2: sbh = 8 and 5as/h = 5, so the paper's figures are integers.
    w = Workload(layers=1, hidden=4, heads=2, seq=2)
    assert layer_activation_bytes(w, NONE) == 8 * (34 + 5) == 312
    assert layer_activation_bytes(w, SEL) == 8 * 34 == 272
    assert layer_activation_bytes(w, FULL) == 2 * 8 == 16
    assert layer_activation_bytes(w, OFF) == 0


def test_small_integer_shape_tensor_and_sequence_parallel() -> None:
    tp = Workload(layers=1, hidden=4, heads=2, seq=2, tp=2)
    assert layer_activation_bytes(tp, NONE) == 8 * (10 + 12) + 8 * 5 // 2 == 196
    assert layer_activation_bytes(tp, SEL) == 8 * (10 + 12) == 176
    assert layer_activation_bytes(tp, FULL) == 16  # the paper's 2sbh: not split without SP
    sp = Workload(layers=1, hidden=4, heads=2, seq=2, tp=2, sequence_parallel=True)
    assert layer_activation_bytes(sp, NONE) == 8 * 39 // 2 == 156
    assert layer_activation_bytes(sp, SEL) == 8 * 34 // 2 == 136
    assert layer_activation_bytes(sp, FULL) == 8


def test_fp32_keeps_masks_at_one_byte() -> None:
    # 34 = 16 two-byte elements + 2 mask bytes -> 16*4 + 2 = 66; 5 = 2 elements + 1 mask -> 9.
    w = Workload(layers=1, hidden=4, heads=2, seq=2, dtype="fp32")
    assert layer_activation_bytes(w, NONE) == 8 * (66 + 9) == 600
    assert layer_activation_bytes(w, SEL) == 8 * 66
    assert layer_activation_bytes(w, FULL) == 8 * 4


def test_flash_attention_equals_selective_figure() -> None:
    w = Workload(layers=1, hidden=4, heads=2, seq=2, flash_attention=True)
    assert layer_activation_bytes(w, NONE) == layer_activation_bytes(w, SEL) == 272


@pytest.mark.parametrize("s,b,h,a,t", [(2, 1, 4, 2, 1), (16, 3, 64, 8, 4), (2048, 1, 12288, 96, 8),
                                       (8192, 2, 8192, 64, 8), (512, 4, 1024, 16, 2)])
def test_table2_formulas(s: int, b: int, h: int, a: int, t: int) -> None:
    """Every row of Korthikanti Table 2, written as in the paper, in exact rationals."""
    sbh, score = s * b * h, Fraction(5 * a * s, h)
    rows = {
        (False, NONE): sbh * (10 + Fraction(24, t) + score / t),
        (False, SEL): sbh * (10 + Fraction(24, t)),
        (False, FULL): 2 * sbh,
        (True, NONE): Fraction(sbh, t) * (34 + score),
        (True, SEL): Fraction(sbh * 34, t),
        (True, FULL): Fraction(2 * sbh, t),
    }
    for (sp, policy), expected in rows.items():
        w = Workload(layers=1, hidden=h, heads=a, seq=s, batch=b, tp=t, sequence_parallel=sp)
        assert layer_activation_bytes(w, policy) == expected, (sp, policy)


def test_ffn_hidden_changes_only_the_mlp_term() -> None:
    # MLP stores 2 * (2 * s*b*F) bytes for its two F-wide tensors: F = 4h is the paper's 16 sbh.
    base = Workload(layers=1, hidden=64, heads=4, seq=8)
    wide = Workload(layers=1, hidden=64, heads=4, seq=8, ffn_hidden=512)
    assert layer_activation_bytes(wide, SEL) - layer_activation_bytes(base, SEL) == 4 * 8 * (512 - 256)
    assert parameter_count(wide) - parameter_count(base) == 2 * 64 * (512 - 256)


@pytest.mark.parametrize("name,ratio,saving", [("175B", 80, 0.70), ("530B", 64, 0.65)])
def test_paper_selective_saving(name: str, ratio: int, saving: float) -> None:
    w = paper_workload(name, tp=1, sequence_parallel=False)
    assert Fraction(5 * w.heads * w.seq, w.hidden) == ratio
    none, sel = layer_activation_bytes(w, NONE), layer_activation_bytes(w, SEL)
    assert round(1 - sel / none, 2) == saving


@pytest.mark.parametrize("name,overhead", [("175B", 0.027), ("530B", 0.016)])
def test_paper_selective_flops_overhead(name: str, overhead: float) -> None:
    # The paper quotes 2.7% / 1.6%; the attention core's share of a layer's forward FLOPs is
    # 2.70% / 1.64% (its own s/(6h) approximation gives 2.8% / 1.7%), hence the tolerance.
    w = paper_workload(name)
    assert attention_core_flops(w) / layer_forward_flops(w) == pytest.approx(overhead, abs=5e-4)


@pytest.mark.parametrize("name", PAPER_MODELS)
def test_paper_five_x_reduction(name: str) -> None:
    """Abstract: SP + selective cuts activation memory ~5x against the TP-only baseline."""
    baseline = layer_activation_bytes(paper_workload(name, sequence_parallel=False), NONE)
    present = layer_activation_bytes(paper_workload(name), SEL)
    assert 4.9 < baseline / present < 6.3
    if name == "175B":
        assert Fraction(baseline, present) == Fraction(23, Fraction(34, 8))


@pytest.mark.parametrize("name", PAPER_MODELS)
def test_paper_model_flops_formula(name: str) -> None:
    """Appendix A: 72 b s L h^2 (1 + s/(6h) + V/(12 h L)) per step, here per GPU with t = 1."""
    w = paper_workload(name, tp=1, sequence_parallel=False)
    b, s, L, h, V = w.batch, w.seq, w.layers, w.hidden, w.vocab
    assert step_flops(w) == 72 * b * s * L * h * h * (1 + Fraction(s, 6 * h) + Fraction(V, 12 * h * L))


@pytest.mark.parametrize("name,billions", [("22B", 22), ("175B", 175), ("530B", 530), ("1T", 1000)])
def test_paper_parameter_counts(name: str, billions: int) -> None:
    assert parameter_count(paper_workload(name)) / 1e9 == pytest.approx(billions, rel=0.01)


def test_state_bytes_mixed_precision_adam_and_zero() -> None:
    w = Workload(layers=2, hidden=8, heads=2, seq=4, vocab=16)
    params = 2 * 12 * 64 + 16 * 8
    assert parameter_count(w) == params
    assert state_bytes(w) == (2 * params, 2 * params, 12 * params)
    assert state_bytes(Workload(layers=2, hidden=8, heads=2, seq=4, vocab=16, dtype="fp32")) == (
        4 * params, 4 * params, 8 * params)
    assert state_bytes(Workload(layers=2, hidden=8, heads=2, seq=4, vocab=16, tp=2)) == (
        params, params, 6 * params)
    zero2 = Workload(layers=2, hidden=8, heads=2, seq=4, vocab=16, dp=4, zero=2)
    assert state_bytes(zero2) == (2 * params, params // 2, 3 * params)


# -- the search ------------------------------------------------------------------------


def rows_literal() -> dict[Policy, PolicyRow]:
    """Hand-made per-layer figures: selective saves 40 for 1, full saves 90 for 5, offload all for 20."""
    return {
        NONE: PolicyRow(NONE, 0, 100, 0, 0.0),
        SEL: PolicyRow(SEL, 0, 60, 40, 1.0),
        FULL: PolicyRow(FULL, 0, 10, 90, 5.0),
        OFF: PolicyRow(OFF, 0, 0, 100, 20.0),
    }


def brute_force(rows: dict[Policy, PolicyRow], layers: int, budget: int) -> float | None:
    costs = []
    for split in itertools.product(range(layers + 1), repeat=3):
        if sum(split) <= layers:
            counts = dict(zip((SEL, FULL, OFF), split), **{NONE: layers - sum(split)})
            counts = {p: n for p, n in counts.items() if p in rows}
            if sum(counts.values()) == layers and activation_peak(rows, counts) <= budget:
                costs.append(sum(n * rows[p].extra_seconds for p, n in counts.items()))
    return min(costs) if costs else None


def test_literal_rows_progression() -> None:
    rows = rows_literal()
    assert search_counts(rows, 4, 400)[0] == {OFF: 0, FULL: 0, SEL: 0, NONE: 4}
    assert search_counts(rows, 4, 399)[0] == {OFF: 0, FULL: 0, SEL: 1, NONE: 3}
    # Four selective layers store 240 but rebuilding one's scores peaks at 280; 3 + 1 none is 280 too.
    assert search_counts(rows, 4, 280)[0] == {OFF: 0, FULL: 0, SEL: 3, NONE: 1}
    assert search_counts(rows, 4, 279)[0][FULL] == 1
    tight = search_counts(rows, 4, 150)[0]
    assert tight is not None and tight[FULL] > 0
    counts, lowest = search_counts(rows, 4, 99)
    assert counts is None and lowest == 100  # all offloaded, one layer brought back at a time


@pytest.mark.parametrize("drop", [(), (OFF,), (SEL,), (OFF, SEL)])
def test_search_matches_brute_force(drop: tuple[Policy, ...]) -> None:
    rows = {p: r for p, r in rows_literal().items() if p not in drop}
    for layers in (1, 3, 5):
        for budget in range(0, 100 * layers + 41, 13):
            counts, _ = search_counts(rows, layers, budget)
            expected = brute_force(rows, layers, budget)
            got = None if counts is None else sum(n * rows[p].extra_seconds for p, n in counts.items() if n)
            assert got == expected, (drop, layers, budget)


# -- plan_layers end to end ------------------------------------------------------------


def example() -> Workload:
    """The 80-layer, h=8192 model at s=8192 on TP 8 + SP with ZeRO-1 over 8 data-parallel ranks."""
    return Workload(layers=80, hidden=8192, heads=64, seq=8192, tp=8, sequence_parallel=True, dp=8, zero=1)


def fixed_bytes(w: Workload) -> int:
    return sum(state_bytes(w))


def test_plenty_of_memory_keeps_everything() -> None:
    w = example()
    budget = fixed_bytes(w) + w.layers * layer_activation_bytes(w, NONE)
    plan = plan_layers(w, Hardware(memory_bytes=budget))
    assert plan.counts()[NONE] == 80 and plan.extra_seconds == 0
    assert plan.memory.total == budget


def test_a_bit_less_memory_uses_selective() -> None:
    w = example()
    budget = fixed_bytes(w) + w.layers * layer_activation_bytes(w, NONE) - 1
    plan = plan_layers(w, Hardware(memory_bytes=budget))
    assert plan.counts() == {NONE: 79, SEL: 1, FULL: 0, OFF: 0}
    assert plan.memory.total <= budget


def test_80gb_example() -> None:
    plan = plan_layers(example(), Hardware(memory_bytes=parse_bytes("80GB")))
    assert plan.counts() == {NONE: 4, SEL: 76, FULL: 0, OFF: 0}
    assert 0 < plan.extra_fraction < 0.2


def test_very_little_memory_uses_full_or_offload() -> None:
    w = Workload(layers=80, hidden=8192, heads=64, seq=8192, tp=8, dp=8, zero=1)  # no SP
    budget = fixed_bytes(w) + 20 * layer_activation_bytes(w, SEL)
    recompute = plan_layers(w, Hardware(memory_bytes=budget, pcie_gbps=0))
    assert recompute.counts()[FULL] > 40 and OFF not in recompute.counts()  # pcie 0: no offload
    fast_link = plan_layers(w, Hardware(memory_bytes=budget, pcie_gbps=1e6))  # transfers hide fully
    assert fast_link.counts()[OFF] > 0 and fast_link.extra_seconds < recompute.extra_seconds


def test_impossible_reports_exact_minimum() -> None:
    w = Workload(layers=8, hidden=1024, heads=16, seq=2048, vocab=32000)
    hw = Hardware(memory_bytes=parse_bytes("1GB"), pcie_gbps=0)
    with pytest.raises(DoesNotFitError) as info:
        plan_layers(w, hw)
    needed = info.value.needed_bytes
    assert "does not fit" in str(info.value) and str(needed) in str(info.value)
    assert plan_layers(w, Hardware(memory_bytes=needed, pcie_gbps=0)).memory.total == needed
    with pytest.raises(DoesNotFitError):
        plan_layers(w, Hardware(memory_bytes=needed - 1, pcie_gbps=0))


def test_more_memory_never_costs_more() -> None:
    w = Workload(layers=12, hidden=1024, heads=16, seq=4096, tp=2, sequence_parallel=True)
    with pytest.raises(DoesNotFitError) as info:
        plan_layers(w, Hardware(memory_bytes=1))
    floor = info.value.needed_bytes
    costs = [plan_layers(w, Hardware(memory_bytes=floor + k * 2**27)).extra_seconds for k in range(0, 40, 3)]
    assert costs == sorted(costs, reverse=True)


def test_flash_attention_offers_no_selective() -> None:
    w = Workload(layers=4, hidden=256, heads=4, seq=1024, flash_attention=True)
    plan = plan_layers(w, Hardware(memory_bytes=parse_bytes("1GiB")))
    assert SEL not in plan.counts()


def test_json_round_trip() -> None:
    plan = plan_layers(example(), Hardware(memory_bytes=parse_bytes("80GB")))
    data = json.loads(json.dumps(plan.to_dict()))
    assert LayerPlan.from_dict(data) == plan
    assert data["counts"] == {"none": 4, "selective": 76, "full": 0, "offload": 0}
    assert data["memory"]["total"] == plan.memory.total


# -- inputs ----------------------------------------------------------------------------


@pytest.mark.parametrize("text,value", [("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("1.5MiB", 3 * 2**19),
                                        ("512 mb", 512 * 10**6), ("100B", 100)])
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["80XB", "-80GB", "80", "0GB", "GB", "8 0GB"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_bytes(text)


@pytest.mark.parametrize("kwargs,message", [
    (dict(hidden=100, heads=3), "not divisible by --heads"),
    (dict(hidden=96, heads=6, tp=4), "not divisible by --tp"),
    (dict(layers=-1), "--layers must be at least 1"),
    (dict(seq=10, tp=4, sequence_parallel=True), "--sequence-parallel"),
    (dict(ffn_hidden=30, tp=4), "--ffn-hidden"),
])
def test_workload_validation(kwargs: dict, message: str) -> None:
    shape = dict(layers=2, hidden=64, heads=4, seq=8)
    with pytest.raises(ValueError, match=message):
        Workload(**{**shape, **kwargs})


# -- pipeline parallelism (Korthikanti et al. 2022, section 4) --------------------------------


def _keep_all(w: Workload) -> LayerPlan:
    """The plan with memory to spare: every layer keeps everything."""
    return plan_layers(w, Hardware(memory_bytes=10**15))


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_1f1b_first_stage_holds_the_whole_models_activations_of_one_microbatch(pp: int) -> None:
    # L/p layers times p micro-batches in flight = L layers: the paper's point that 1F1B's
    # first stage needs the activations of all L layers, independent of p.
    base = dict(layers=16, hidden=1024, heads=16, seq=2048, tp=2, sequence_parallel=True)
    single = _keep_all(Workload(**base))
    staged = _keep_all(Workload(**base, pp=pp, microbatches=4 * pp))
    assert staged.counts() == {NONE: 16 // pp, SEL: 0, FULL: 0, OFF: 0}
    assert staged.memory.layer_activations == single.memory.layer_activations == 16 * layer_activation_bytes(
        Workload(**base), NONE)


def test_1f1b_with_fewer_microbatches_than_stages_holds_only_those() -> None:
    w = Workload(layers=8, hidden=64, heads=4, seq=8, pp=4, microbatches=3)
    assert w.in_flight == 3
    assert _keep_all(w).memory.layer_activations == 2 * 3 * layer_activation_bytes(w, NONE)


@pytest.mark.parametrize("pp,v", [(2, 2), (4, 2), (4, 4), (8, 3)])
def test_interleaved_scales_1f1b_by_the_papers_factor(pp: int, v: int) -> None:
    shape = dict(layers=pp * v * 2, hidden=64, heads=4, seq=8)
    one_f_one_b = _keep_all(Workload(**shape, pp=pp, microbatches=2 * pp))
    interleaved = _keep_all(Workload(**shape, pp=pp, microbatches=2 * pp, schedule="interleaved", virtual_stages=v))
    factor = 1 + Fraction(pp - 1, pp * v)
    assert Workload(**shape, pp=pp, microbatches=2 * pp, schedule="interleaved", virtual_stages=v).in_flight == pp * factor
    stage_layers, per_layer = shape["layers"] // pp, layer_activation_bytes(Workload(**shape), NONE)
    assert one_f_one_b.memory.layer_activations == stage_layers * per_layer * pp
    assert interleaved.memory.layer_activations == stage_layers * math.ceil(per_layer * pp * factor)


def test_pipeline_stage_holds_its_layers_and_the_embedding() -> None:
    w = Workload(layers=8, hidden=64, heads=4, seq=8, vocab=100, pp=4, microbatches=4)
    assert stage_parameter_count(w) == 2 * 12 * 64 * 64 + 100 * 64
    assert state_bytes(w)[0] == 2 * stage_parameter_count(w)  # bf16 weights
    assert other_activation_bytes(w) == 8 * 64 * 4  # one embedding-dropout mask per micro-batch in flight
    assert step_flops(w) == 3 * 2 * layer_forward_flops(w)  # one micro-batch, no logits on the first stage


def test_pipeline_tightens_the_plan() -> None:
    base = dict(layers=32, hidden=4096, heads=32, seq=4096, tp=4, sequence_parallel=True, pp=4)
    alone, in_flight = Workload(**base, microbatches=1), Workload(**base, microbatches=8)
    budget = Hardware(memory_bytes=sum(state_bytes(alone)) + 8 * layer_activation_bytes(alone, NONE))
    assert plan_layers(alone, budget).counts()[NONE] == 8
    tight = plan_layers(in_flight, budget)
    assert tight.counts()[NONE] < 8 and tight.memory.total <= budget.memory_bytes


@pytest.mark.parametrize("kwargs,message", [
    (dict(pp=3), "not divisible by --pp 3"),
    (dict(pp=2, microbatches=3, schedule="interleaved", virtual_stages=2), "multiple of --pp"),
    (dict(pp=2, microbatches=2, schedule="interleaved"), "--virtual-stages 2 or more"),
    (dict(pp=2, virtual_stages=2), "interleaved only"),
    (dict(pp=2, microbatches=2, schedule="gpipe"), "--schedule must be one of"),
    (dict(pp=0), "at least 1"),
])
def test_pipeline_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Workload(layers=8, hidden=64, heads=4, seq=8, **kwargs)


def test_pipeline_json_round_trip() -> None:
    w = Workload(layers=8, hidden=64, heads=4, seq=8, pp=2, microbatches=4, schedule="interleaved", virtual_stages=2)
    plan = _keep_all(w)
    assert LayerPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
