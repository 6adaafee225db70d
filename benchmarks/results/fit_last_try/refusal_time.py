"""How long the Inductor fit takes to refuse a peak budget nothing fits, with its last try (the user's
budget planned with the longer search) included.

    PYTHONPATH=. TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/results/fit_last_try/refusal_time.py 60000

The tests' tiny GPT (tests/models.py, dropout 0.1), ``remat_pass.backend(budget=<bytes>, budget_kind="peak",
inner="inductor", chunk_loss=False, plan_cache=False)``, a fresh Inductor cache; the fit's log lines are printed
with milliseconds since the start, so the last try's share is the time after "no candidate fits".
"""

import logging
import sys
import time

import torch

import remat_pass
from tests.helpers import run_step
from tests.models import make_case

logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
for name in ("remat_pass.runtime.dynamo_backend", "remat_pass.runtime.peak_fitting", "remat_pass.runtime.inductor_fit"):
    logging.getLogger(name).setLevel(logging.INFO)

model, inputs, loss_fn = make_case("gpt")
budget = int(sys.argv[1])
backend = remat_pass.backend(budget=budget, budget_kind="peak", inner="inductor", chunk_loss=False, plan_cache=False)
began = time.perf_counter()
try:
    run_step(model, torch.compile(model, backend=backend), inputs, loss_fn)
    print(f"fitted in {time.perf_counter() - began:.1f} s")
except torch._dynamo.exc.BackendCompilerFailed as error:
    print(f"refused in {time.perf_counter() - began:.1f} s: {str(error.inner_exception)[:160]}")
