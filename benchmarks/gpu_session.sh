#!/usr/bin/env bash
# One device session, as run on the lent H200 (benchmarks/GPU.md has the results): the GPU
# preset, remat_pass against Inductor, the cost models, the kernel-scratch check and the offload check.
#   bash benchmarks/gpu_session.sh OUT_DIR [PRESET_MINUTES] [VS_INDUCTOR_MINUTES]
# The device machine has its own torch (2.11 was seen) but not PuLP or HiGHS: carry their wheels
# in .whl/ (benchmarks/README.md says how). The repository is not pip-installed there, so
# solvers/ is linked in where the installed package puts it (remat_pass.solvers).
set -o pipefail
out=${1:-benchmarks/out/gpu_session}
minutes=${2:-5}
vs_minutes=${3:-4}
mkdir -p "$out"
log="$out/run.log"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import remat_pass.solvers" 2>/dev/null || ln -sfn ../solvers remat_pass/solvers
export PYTHONUNBUFFERED=1
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, pulp, highspy; print('torch', torch.__version__, torch.cuda.get_device_name(), 'pulp', pulp.__version__)"
} 2>&1 | tee "$log"
# The benchmark preset: rows not started after $minutes are recorded as skipped.
# (No plots: the device returns at most 8 files.)
timeout $((minutes * 60 + 60)) python3 -m benchmarks --preset gpu --time-limit "$minutes" --out "$out/gpu" --no-plots -v 2>&1 | tee -a "$log"
# remat_pass (inner inductor and eager) at the measured peak of Inductor's default, budget 0.3 and
# per-block checkpointing points (benchmarks/VS_INDUCTOR.md); points not started in time are skipped.
timeout $((vs_minutes * 60 + 120)) python3 -m benchmarks.vs_inductor --preset gpu --time-limit "$vs_minutes" --out "$out/vs_inductor" 2>&1 | tee -a "$log"
# Roofline, FLOP-priced and measured op costs: predicted against measured step-time overhead.
timeout 150 python3 -m benchmarks.cost_models --device cuda --dtype bf16 --quick --out "$out/costs" 2>&1 | tee -a "$log"
# Kernel scratch (cuDNN workspaces) measured per convolution: predicted against allocator peak.
timeout 100 python3 -m benchmarks.scratch_check --device cuda --out "$out/scratch" 2>&1 | tee -a "$log"
timeout 90 python3 -m benchmarks.gpu_offload_check --out "$out" 2>&1 | tee -a "$log"
date -u | tee -a "$log"
