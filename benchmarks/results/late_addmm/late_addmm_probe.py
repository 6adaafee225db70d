"""The measured peaks of VS_INDUCTOR.md's "Inductor's addmm fusion undone": our ``per_block`` plan compiled by
Inductor, with ``capture.late_addmm``'s post-grad pass and with it turned off, on two tied-embedding models.

    PYTHONPATH=. python benchmarks/results/late_addmm/late_addmm_probe.py > benchmarks/results/late_addmm/late_addmm_probe.txt

Turned off means its call does nothing and its identity differs (else Inductor's FX graph cache would answer
the backward's compile with the program made with the pass). The whole loss in both (``chunk_loss=False``).
"""

import contextlib
import copy

import torch

import remat_pass
from benchmarks.models import ModelSpec, build
from benchmarks.strategies import step_with_loss
from remat_pass.capture import late_addmm
from remat_pass.examples import GPT, GPTConfig, lm_loss
from remat_pass.runtime.measure import allocator_peak

torch.set_num_threads(1)


@contextlib.contextmanager
def pass_turned_off():
    call, uuid = late_addmm.UnfuseLateAddmm.__call__, late_addmm.UnfuseLateAddmm.uuid
    late_addmm.UnfuseLateAddmm.__call__ = lambda self, graph: None
    late_addmm.UnfuseLateAddmm.uuid = lambda self: "turned off"
    try:
        yield
    finally:
        late_addmm.UnfuseLateAddmm.__call__, late_addmm.UnfuseLateAddmm.uuid = call, uuid


def per_block_peak(model: torch.nn.Module, inputs: tuple) -> int:
    torch._dynamo.reset()
    step = remat_pass.optimize(model, budget=1.0, budget_kind="saved", solver="per_block", inner="inductor",
                               chunk_loss=False, example_inputs=inputs, plan_cache=False)
    step(*inputs).backward()  # compiles; not measured
    model.zero_grad(set_to_none=True)
    return allocator_peak(lambda: step(*inputs).backward(), "cpu",
                          lambda: [p.grad for p in model.parameters()]).peak_excluding


class GPTStep(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens, targets):
        return lm_loss(self.model(tokens), targets)


def cases():
    work = build(ModelSpec("hf_falcon", 2, 64, 4, 64, 2, vocab=256))
    yield "HF Falcon (2 layers, h64, s64, batch 2, vocab 256)", step_with_loss(work.model, work.loss_fn), \
        (*work.inputs, work.target)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, seq_len=32, layers=2, hidden=32, heads=2, dropout=0.0)
    yield "built-in GPT (2 layers, h32, s32, batch 4, vocab 256; tests/test_late_addmm.py)", GPTStep(GPT(config)), \
        tuple(torch.randint(0, 256, (4, 32)) for _ in range(2))


def main() -> None:
    for name, model, inputs in cases():
        with_pass = per_block_peak(copy.deepcopy(model).train(), inputs)
        with pass_turned_off():
            without = per_block_peak(copy.deepcopy(model).train(), inputs)
        print(f"{name}: per_block compiled by Inductor, {without:,} bytes without the pass, {with_pass:,} with it "
              f"({with_pass / without:.3f})")


if __name__ == "__main__":
    main()
