"""Whether ``torch.addmm(c, a, b)`` equals ``torch.mm(a, b) + c`` bit for bit on this CPU, at three shapes
(VS_INDUCTOR.md, "Inductor's addmm fusion undone": the pass's price in rounding).

    python benchmarks/results/late_addmm/addmm_rounding.py > benchmarks/results/late_addmm/addmm_rounding.txt
"""

import torch

torch.manual_seed(0)
for m, k, n in ((256, 128, 64), (6282, 1024, 192), (37, 1000, 53)):
    a, b, c = torch.randn(m, k), torch.randn(k, n), torch.randn(m, n)
    fused, unfused = torch.addmm(c, a, b), torch.mm(a, b) + c
    print(f"{m}x{k}x{n}: equal {torch.equal(fused, unfused)}, max |difference| {(fused - unfused).abs().max().item():.3g}")
