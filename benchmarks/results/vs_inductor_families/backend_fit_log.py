"""The backend's fit of a peak budget on an HF family, its INFO log printed.

    PYTHONPATH=. python benchmarks/results/vs_inductor_families/backend_fit_log.py falcon 32 16 64 71432

Arguments: family, hidden, sequence, vocabulary, and the peak budget in bytes (default: Hugging Face
checkpointing's peak compiled by torch.compile). Run with ``fused_memory_attempt.patch`` applied, the
line above gave VS_INDUCTOR.md's numbers for the fused-memory model that was tried and not kept.
"""

import logging
import sys

import torch

import remat_pass
from benchmarks.hf_families import family_model
from benchmarks.models import LossOf
from benchmarks.vs_checkpoint import measured_step
from tests.helpers import set_hf_checkpointing


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    for name in ("remat_pass.runtime", "remat_pass.planning.pipeline"):
        logging.getLogger(name).setLevel(logging.INFO)
    torch.set_num_threads(1)
    name, hidden, seq, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.manual_seed(0)
    tokens = torch.randint(0, vocab, (2, seq))
    model = LossOf(family_model(name, layers=2, hidden=hidden, seq=seq, vocab=vocab, heads=4),
                   torch.randint(0, vocab, (2, seq))).train()

    def compiled_peak(step) -> int:
        step(tokens).backward()
        return measured_step(step, model, tokens)["peak_bytes"]

    if len(sys.argv) > 5:
        budget = int(sys.argv[5])
    else:
        set_hf_checkpointing(model.model, True)
        budget = compiled_peak(torch.compile(model))
        set_hf_checkpointing(model.model, False)
        torch._dynamo.reset()
    backend = remat_pass.backend(budget=budget, budget_kind="peak", plan_cache=False)
    measured = compiled_peak(torch.compile(model, backend=backend))
    print(f"budget {budget} bytes: measured {measured} bytes ({measured / budget:.3f})")


if __name__ == "__main__":
    main()
