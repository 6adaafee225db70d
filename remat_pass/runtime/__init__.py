"""Stage 5, runtime: ``optimize``, the ``torch.compile`` backend, the per-block wrapper and the plan cache."""
