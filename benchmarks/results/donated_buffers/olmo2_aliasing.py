"""How many of the OLMo2 regression test's compiles save tensors that share a storage (and so donate nothing):
the test (``tests/test_more_families.py``, the peak-budget backend on Inductor) run with Inductor's caches off,
``capture.donated_buffers.saved_tensors_share_storage`` counted from outside.

    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 python benchmarks/results/donated_buffers/olmo2_aliasing.py
"""

from __future__ import annotations

import pytest

import remat_pass.capture.donated_buffers as donated

verdicts: list[bool] = []
checked = donated.saved_tensors_share_storage


def counted(forward, num_fwd_outputs):  # type: ignore[no-untyped-def]
    verdicts.append(checked(forward, num_fwd_outputs))
    return verdicts[-1]


donated.saved_tensors_share_storage = counted
code = pytest.main(["-q", "-p", "no:cacheprovider", "-m", "slow", "tests/test_more_families.py", "-k", "share_storage"])
print(f"pytest exit {code}; compiles checked {len(verdicts)}; saving tensors that share a storage {sum(verdicts)}")
