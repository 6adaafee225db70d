"""Stage 3, plan: the driver (budget, trace, plan, rewrite, reconcile) and ``remat_pass.plan``, which stops before running."""
