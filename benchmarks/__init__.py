"""Benchmarks of activation-memory strategies against remat_pass (``python -m benchmarks --help``).

Not part of the installed package: run from the repository root.
"""
