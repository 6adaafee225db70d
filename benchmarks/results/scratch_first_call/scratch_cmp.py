"""Kernel scratch per node on five benchmark models' joint graphs (first-call HF GPT-2, GPT with dropout,
ResNet fp32 and bf16, Llama), as JSON (model and node -> bytes). Run once with ``annotate/scratch.py`` as before
ab873f8 (which measured every kernel twice) and once after, then compare the two files: ``scratch_old.json`` and
``scratch_new.json`` here, the same 154 nodes, none different.

    PYTHONPATH=. python benchmarks/results/scratch_first_call/scratch_cmp.py OUT.json
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

from benchmarks.models import ModelSpec, Workload, build
from benchmarks.scaling import first_call_model
from remat_pass.annotate import scratch
from remat_pass.capture.capture import capture


class WithLoss(nn.Module):
    """A benchmark workload's model with its loss inside the step."""

    def __init__(self, work: Workload) -> None:
        super().__init__()
        self.work, self.model = work, work.model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.work.loss_fn(self.model(x), self.work.target)


def scratch_of(label: str, model: nn.Module, inputs: tuple) -> dict[str, int]:
    torch.manual_seed(0)
    found = {}
    for joint in capture(model, inputs):
        graph = joint.module.graph
        gradients = [n for n in graph.nodes if n.op == "output"][0].args[0][joint.num_fwd_outputs:]
        for node, nbytes in scratch.kernel_scratch(graph, gradients).items():
            found[f"{label} {node.name}"] = nbytes
    return found


def main(out: str) -> None:
    model, tokens, _ = first_call_model()
    found = scratch_of("gpt2", model, (tokens,))
    for spec, dtype in ((ModelSpec("gpt", layers=2, hidden=128, seq=128, dropout=0.1), torch.float32),
                        (ModelSpec("resnet", layers=4, hidden=16, seq=32, batch=8), torch.float32),
                        (ModelSpec("resnet", layers=4, hidden=16, seq=32, batch=8), torch.bfloat16),
                        (ModelSpec("llama", layers=2, hidden=128, seq=128), torch.float32)):
        work = build(spec, dtype=dtype)
        found.update(scratch_of(f"{spec.label}-{dtype}", WithLoss(work), work.inputs))
    with open(out, "w") as handle:
        json.dump(found, handle, indent=0, sort_keys=True)
    print(len(found), "nodes with scratch")


if __name__ == "__main__":
    main(sys.argv[1])
