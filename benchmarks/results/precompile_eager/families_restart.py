"""Does torch's precompile save optimize's default (inner="eager") step of each HF family, and does a
restarted process run it without remat_pass, with the same loss, gradients and saved bytes?

    PYTHONPATH=. python benchmarks/results/precompile_eager/families_restart.py [family ...]

Per family, two new processes share a fresh TORCHINDUCTOR_CACHE_DIR and plan cache, both with
TORCH_CACHING_PRECOMPILE=1: the first runs two steps of ``remat_pass.optimize(LossOf(model), budget=0.3)``
and saves the artifacts; the second runs one step with remat_pass's backend made to fail if called.
2 layers, h64, s64, batch 2, vocabulary 256, dropout off (HF configs), CPU fp32.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time

FAMILIES = ["gpt2", "llama", "bert", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gpt_neox", "opt", "falcon",
            "roberta"]


def one_process(family: str, mode: str) -> None:
    import logging
    import warnings

    import torch

    import remat_pass
    from benchmarks.models import LossOf, hf_model
    from remat_pass.runtime import dynamo_backend

    warnings.simplefilter("ignore")
    logging.getLogger("torch._dynamo.guards").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = LossOf(hf_model(family, 2, 64, 64, 256), torch.randint(0, 256, (2, 64))).train()
    tokens = torch.randint(0, 256, (2, 64))
    if mode == "restart":
        def not_called(self, gm, example_inputs):
            raise AssertionError("remat_pass's backend was called: precompile did not answer the step")
        dynamo_backend.RematBackend.__call__ = not_called
    optimized = remat_pass.optimize(model, budget=0.3, plan_cache=os.environ["PLANS"])
    for step in range(1 if mode == "restart" else 2):
        model.zero_grad(set_to_none=True)
        began = time.perf_counter()
        loss = optimized(tokens)
        loss.backward()
        took = time.perf_counter() - began
    grads = hashlib.sha256(b"".join(p.grad.numpy().tobytes() for p in model.parameters() if p.grad is not None))
    plan = optimized.plan
    print(f"{family} {mode}: last step {took:.3f} s, loss {loss.item():.6f}, grads {grads.hexdigest()[:12]}, "
          f"plan keeps {None if plan is None else plan.kept_bytes} B", flush=True)
    if mode == "save":
        torch.compiler.save_cache_artifacts()


def main(families: list[str]) -> None:
    for family in families:
        caches = tempfile.mkdtemp(prefix=f"pc_{family}_")
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"),
               "PLANS": os.path.join(caches, "plans"), "TORCH_CACHING_PRECOMPILE": "1"}
        for mode in ("save", "restart"):
            done = subprocess.run([sys.executable, __file__, "--one", family, mode], env=env,
                                  capture_output=True, text=True)
            lines = [line for line in (done.stdout + done.stderr).splitlines()
                     if line.startswith(family) or "serialize" in line or "Backend not found" in line
                     or "Error" in line]
            print("\n".join(lines[-4:]) or f"{family} {mode}: rc {done.returncode}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        one_process(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1:] or FAMILIES)
