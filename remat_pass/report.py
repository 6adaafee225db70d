"""How plans are put into words: number formats shared by every report.

(``format_bytes`` lives beside ``Plan`` in the torch-free ``solvers.problem``.)
"""

from __future__ import annotations


def format_flops(count: float) -> str:
    """Readable FLOP count: 2048 -> '2.05 kFLOP'."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(count) >= scale:
            return f"{count / scale:.3g} {prefix}FLOP"
    return f"{count:.0f} FLOP"
