"""The numbers of VS_INDUCTOR.md's "Nine held-out families" about HF Falcon that the table does not print.

    PYTHONPATH=. python benchmarks/results/vs_inductor_families/falcon_probes.py > falcon_probes.txt

1. Joint-graph nodes of the h32 Falcon step (the test's old tiny sizes) as traced for eager and for Inductor
   (Inductor's decompositions split GELU, layer norm and the softmaxes into pointwise chains).
2. The h64 Falcon (the table's sizes) under ``per_block`` compiled by Inductor, the whole loss: its measured
   peak with Inductor's pattern matcher on and off (off removes the add(mm, x) -> addmm fusion, among others),
   and with the loss chunked; plain torch.compile beside it, both ways.
"""

import copy

import torch

import remat_pass
from benchmarks.hf_families import family_model
from benchmarks.models import LossOf, ModelSpec, build
from benchmarks.strategies import step_with_loss
from remat_pass.runtime import dynamo_backend
from remat_pass.runtime.measure import allocator_peak

torch.set_num_threads(1)


def joint_nodes(inner: str) -> int:
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (2, 16))
    model = LossOf(family_model("falcon", layers=2, hidden=32, seq=16, vocab=64, heads=4),
                   torch.randint(0, 64, (2, 16))).train()
    counted = []
    plan = dynamo_backend.plan_joint_graph

    def count(joint, options):
        counted.append(len(joint.module.graph.nodes))
        return plan(joint, options)

    dynamo_backend.plan_joint_graph = count
    try:
        torch._dynamo.reset()
        torch.compile(model, backend=remat_pass.backend(budget=0.5, inner=inner, plan_cache=False))(tokens).backward()
    finally:
        dynamo_backend.plan_joint_graph = plan
    return counted[0]


def peak(step, model) -> int:
    step()
    model.zero_grad(set_to_none=True)
    return allocator_peak(step, "cpu", lambda: [p.grad for p in model.parameters()]).peak_excluding


def main() -> None:
    for inner in ("eager", "inductor"):
        print(f"h32 Falcon, joint-graph nodes traced for inner={inner!r}: {joint_nodes(inner)}")
    work = build(ModelSpec("hf_falcon", 2, 64, 4, 64, 2, vocab=256))
    for matcher, chunk in ((True, False), (False, False), (True, True)):
        model = copy.deepcopy(work.model)
        torch._dynamo.reset()
        with torch._inductor.config.patch(pattern_matcher=matcher):
            step = remat_pass.optimize(step_with_loss(model, work.loss_fn), budget=1.0, budget_kind="saved",
                                       solver="per_block", inner="inductor", chunk_loss=chunk,
                                       example_inputs=(*work.inputs, work.target), plan_cache=False)
            measured = peak(lambda: step(*work.inputs, work.target).backward(), model)
        print(f"h64 Falcon, per_block compiled by Inductor, pattern_matcher={matcher}, chunk_loss={chunk}: {measured} bytes")
    for matcher in (True, False):
        model = copy.deepcopy(work.model)
        torch._dynamo.reset()
        with torch._inductor.config.patch(pattern_matcher=matcher):
            plain = torch.compile(step_with_loss(model, work.loss_fn))
            measured = peak(lambda: plain(*work.inputs, work.target).backward(), model)
        print(f"h64 Falcon, plain torch.compile, pattern_matcher={matcher}: {measured} bytes")


if __name__ == "__main__":
    main()
