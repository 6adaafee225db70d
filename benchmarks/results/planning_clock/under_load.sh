#!/bin/bash
# The Inductor fit of HF GPT-2 (2 layers, h64) at torch's 0.1 point, with three busy processes beside it,
# on two checkouts: before the planning clock (b762907, a `git worktree`) and after it (389cdad).
#   bash under_load.sh /path/to/before /path/to/after
# Raw output of the run of 2026-12-06 17:40-17:53 UTC: under_load_log.txt, hf_gpt2_0.1_{before,after}.md.
python=${PYTHON:-python}
for k in 1 2 3; do (timeout 1200 python3 -c "while True: pass" &) ; done
for tree in "$@"; do
  echo "=== $tree $(date -u +%H:%M:%S)"
  (cd "$tree" && PYTHONPATH="$tree" $python -m benchmarks.vs_inductor --model hf_gpt2 --points 0.1 --inners inductor \
     --rounds 1 --out "out_$(basename "$tree")" 2>&1 | grep -E "^hf_gpt2" | cut -c1-200)
done
pkill -f "while True: pass"
echo "=== done $(date -u +%H:%M:%S)"
