"""The measured peak of ``optimize(..., inner="inductor")`` with AOTAutograd's donated buffers three ways, one
new process per row (a fresh ``TORCHINDUCTOR_CACHE_DIR`` each): ``all_off`` (the blanket switch of 72620da:
``donated_buffer=False`` around everything), ``unchecked`` (donation on everywhere, torch's default: unsafe
where saved tensors share a storage, measured only to price the switch), ``main`` (the library as it is:
kept views made again in backward, donation off only where saved tensors still share a storage).
2-layer HF models (h128, 4 heads, s128, batch 2, vocab 512), saved-bytes budgets, CPU fp32. One JSON line
per row: the activation peak at the allocator (parameter gradients left out) and max |dg| / max |g|
against eager over all parameters.

    PYTHONPATH=. python benchmarks/results/donated_buffers/donation_peaks.py            # every row
    PYTHONPATH=. python benchmarks/results/donated_buffers/donation_peaks.py gpt2 0.3 main   # one row
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile

import torch

MODELS, BUDGETS, WAYS = ("gpt2", "llama", "bert"), (0.3, 0.1), ("all_off", "unchecked", "main")


def row(name: str, budget: float, way: str) -> dict[str, object]:
    from benchmarks.models import LossOf, hf_model
    import remat_pass
    import remat_pass.capture.donated_buffers as donated
    from remat_pass.runtime.measure import peak_activation_bytes

    torch.manual_seed(0)
    if way == "unchecked":
        donated.stop_donating_buffers = lambda: None
    scope = torch._functorch.config.patch(donated_buffer=False) if way == "all_off" else contextlib.nullcontext()
    tokens = torch.randint(0, 512, (2, 128))
    model = LossOf(hf_model(name, 2, 128, 128, 512, heads=4), tokens).train()
    model(tokens).backward()
    eager = [p.grad.clone() for p in model.parameters()]
    with scope:
        fast = remat_pass.optimize(model, budget, example_inputs=(tokens,), inner="inductor")

        def step() -> torch.Tensor:
            model.zero_grad(set_to_none=True)
            loss = fast(tokens)
            loss.backward()
            return loss

        step(), step()
        _, peak = peak_activation_bytes(step, survivors=lambda: [p.grad for p in model.parameters()])
    error = max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), eager))
    scale = max(g.abs().max().item() for g in eager)
    return {"model": name, "budget": budget, "way": way, "peak_bytes": peak, "grad_vs_eager": error / scale}


def main() -> None:
    if len(sys.argv) == 4:
        print(json.dumps(row(sys.argv[1], float(sys.argv[2]), sys.argv[3])), flush=True)
        return
    for name in MODELS:
        for budget in BUDGETS:
            for way in WAYS:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp())
                out = subprocess.run([sys.executable, __file__, name, str(budget), way], env=env, text=True,
                                     capture_output=True, check=True).stdout
                print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
